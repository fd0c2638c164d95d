//! Several sequences on one context (`ParallelSession`), on the default model: each
//! sequence generates, greedily, exactly what a `Session` holding it alone generates, with its
//! prompt calls interleaved with the other sequences' and its decode steps batched with theirs;
//! a next prompt reuses what a fresh prefill would reach unchanged; a sequence can run its own
//! memory selection; bad sequences and prompts are typed errors.

mod common;

use h2o_llama::{
    ChatMessage, Error, FlashAttention, H2oConfig, Integrity, ParallelSession, Sampler,
    SamplerConfig, Selection, Session, SessionConfig, Token,
};

const N_PREDICT: usize = 12;

fn config(h2o: Option<H2oConfig>) -> SessionConfig {
    SessionConfig {
        n_ctx: 1024,
        n_batch: 256,
        n_ubatch: 64,
        n_threads: 2,
        // as ParallelSession runs several sequences (see its documentation)
        flash_attn: FlashAttention::Off,
        h2o,
        // so that a next prompt can cut a sequence back to a chunk boundary inside its prompt
        h2o_undo_log: h2o.is_some(),
        ..SessionConfig::default()
    }
}

fn h2o() -> Option<H2oConfig> {
    if cfg!(feature = "stock") {
        None
    } else {
        Some(H2oConfig::seed(16, 16))
    }
}

/// Prompts of different lengths: several chunks, a chunk and one token, a single call.
fn prompts() -> Vec<Vec<Token>> {
    let m = common::model();
    let text = "The lighthouse keeper counted the ships that passed the cape each night, \
                and wrote their names in a book that nobody else ever read. ";
    let all = m.tokenize(&text.repeat(40), true, false).unwrap();
    vec![all[..300].to_vec(), all[..129].to_vec(), all[..40].to_vec()]
}

/// Greedy tokens a session generates for `prompt` alone, stopping at end of generation.
fn alone(prompt: &[Token], h2o: Option<H2oConfig>) -> Vec<Token> {
    let m = common::model();
    let mut s = Session::new(m, config(h2o)).unwrap();
    let mut greedy = Sampler::new(&SamplerConfig::greedy()).unwrap();
    s.generate(prompt, &mut greedy, N_PREDICT, |_| true)
        .unwrap()
        .tokens
}

/// Runs every prompt in its own sequence of `p`: prefill calls round-robin, then decode steps of
/// all unfinished sequences together; returns each sequence's generated tokens.
fn together(
    p: &mut ParallelSession<'_>,
    prompts: &[Vec<Token>],
    kept: &[usize],
) -> Vec<Vec<Token>> {
    let m = common::model();
    let mut samplers: Vec<Sampler> = prompts
        .iter()
        .map(|_| Sampler::new(&SamplerConfig::greedy()).unwrap())
        .collect();
    let mut done = kept.to_vec();
    let mut out: Vec<Vec<Token>> = vec![Vec::new(); prompts.len()];
    let mut next: Vec<Option<Token>> = vec![None; prompts.len()];
    let mut finished = vec![false; prompts.len()];
    while done.iter().zip(prompts).any(|(&d, pr)| d < pr.len()) {
        for (i, pr) in prompts.iter().enumerate() {
            if done[i] < pr.len() {
                done[i] += p.prefill(i as u32, &pr[done[i]..], usize::MAX).unwrap();
                if done[i] == pr.len() {
                    next[i] = Some(p.sample_last(&mut samplers[i]));
                }
            }
        }
    }
    loop {
        let mut step = Vec::new();
        for i in 0..prompts.len() {
            if let Some(t) = next[i].take() {
                if m.is_end_of_generation(t) {
                    finished[i] = true;
                    continue;
                }
                out[i].push(t);
                if out[i].len() == N_PREDICT {
                    finished[i] = true;
                } else {
                    step.push((i as u32, t));
                }
            }
        }
        if step.is_empty() {
            break;
        }
        p.decode(&step).unwrap();
        for (k, &(seq, _)) in step.iter().enumerate() {
            next[seq as usize] = Some(p.sample_at(&mut samplers[seq as usize], k));
        }
    }
    assert!(finished.iter().all(|&f| f));
    out
}

#[test]
fn each_sequence_generates_what_a_session_alone_generates() {
    let m = common::model();
    let prompts = prompts();
    for h in [None, h2o()] {
        let mut p = ParallelSession::new(m, config(h), prompts.len() as u32).unwrap();
        assert_eq!((p.n_seq(), p.n_ctx_seq()), (3, 1024));
        let kept: Vec<usize> = prompts
            .iter()
            .enumerate()
            .map(|(i, pr)| p.start_prompt(i as u32, pr, None).unwrap())
            .collect();
        assert_eq!(kept, vec![0, 0, 0]);
        let got = together(&mut p, &prompts, &kept);
        for (i, pr) in prompts.iter().enumerate() {
            assert_eq!(
                got[i],
                alone(pr, h),
                "sequence {i} ({} prompt tokens), H2O {h:?}",
                pr.len()
            );
            assert_eq!(p.tokens(i as u32)[..pr.len()], pr[..]);
        }
        if h.is_some() {
            let st = p.h2o_state(0).expect("H2O state of sequence 0");
            assert_eq!(
                (st.chunks_done, st.tokens_done),
                (4, 256),
                "300 prompt tokens, S = 64"
            );
            assert_eq!(
                p.h2o_state(2).unwrap().chunks_done,
                0,
                "40 tokens: no chunk complete"
            );
        } else {
            assert!(p.h2o_state(0).is_none());
        }
    }
}

#[test]
fn a_next_prompt_reuses_what_a_fresh_prefill_would_reach() {
    let m = common::model();
    let prompts = prompts();
    let mut p = ParallelSession::new(m, config(h2o()), 2).unwrap();
    let first = &prompts[0];
    p.start_prompt(0, first, None).unwrap();
    together(&mut p, std::slice::from_ref(first), &[0]);

    // the next turn: the whole history plus more text
    let mut next = p.tokens(0).to_vec();
    next.extend_from_slice(&prompts[2]);
    let kept = p.start_prompt(0, &next, None).unwrap();
    let expect = if h2o().is_some() {
        256 // the last chunk boundary inside the first prompt (300 tokens, S = 64)
    } else {
        first.len() + N_PREDICT - 1 // all but the last generated token, which was never evaluated
    };
    assert_eq!(kept, expect);
    let got = together(&mut p, std::slice::from_ref(&next), &[kept]);
    assert_eq!(got[0], alone(&next, h2o()), "reused {kept} tokens");
}

#[test]
#[cfg(not(feature = "stock"))]
fn a_sequence_runs_its_own_memory_selection() {
    let m = common::model();
    let prompts = prompts();
    let hybrid = H2oConfig {
        select: Selection::Hybrid,
        sink: 4,
        // longer than the last 64-token call of a 300-token prompt (44 tokens)
        dense_tail: 48,
        ..H2oConfig::seed(16, 16)
    };
    let mut p = ParallelSession::new(m, config(h2o()), 2).unwrap();
    p.start_prompt(0, &prompts[0], None).unwrap();
    p.start_prompt(1, &prompts[0], Some(hybrid)).unwrap();
    // a sketch left out is the context's, chosen for the model's key heads
    let resolved = |h: H2oConfig| h.for_model(m);
    assert_eq!(
        (p.h2o(0), p.h2o(1)),
        (h2o().map(resolved), Some(resolved(hybrid)))
    );
    let got = together(&mut p, &[prompts[0].clone(), prompts[0].clone()], &[0, 0]);
    assert_eq!(got[0], alone(&prompts[0], h2o()));
    assert_eq!(got[1], alone(&prompts[0], Some(hybrid)));

    // prompt calls of one chunk (a server's, while other sequences generate) keep the dense
    // tail whole in the last call, as a fresh session's
    assert_eq!(p.start_prompt(0, &prompts[0], Some(hybrid)).unwrap(), 0);
    let mut done = 0;
    while done < prompts[0].len() {
        let k = p.prefill(0, &prompts[0][done..], 64).unwrap();
        assert!(
            k <= 64 || done + k == prompts[0].len(),
            "a call of {k} tokens at {done}"
        );
        done += k;
    }
    let mut greedy = Sampler::new(&SamplerConfig::greedy()).unwrap();
    let first = p.sample_last(&mut greedy);
    assert_eq!(first, alone(&prompts[0], Some(hybrid))[0]);

    // a new selection starts the sequence over; L and H are the context's
    assert_eq!(p.start_prompt(1, &prompts[0], None).unwrap(), 0);
    assert_eq!(p.h2o(1), h2o().map(resolved));
    let err = p
        .start_prompt(1, &prompts[0], Some(H2oConfig::seed(8, 24)))
        .unwrap_err();
    assert!(err.to_string().contains("L = 16, H = 16"), "{err}");
    // what is set for the whole context is not a sequence's to change
    for (other, flag) in [
        (
            H2oConfig {
                tile_samples: 8,
                ..hybrid
            },
            "--h2o-tile-samples",
        ),
        (
            H2oConfig {
                tile_sketch: 2,
                ..hybrid
            },
            "--h2o-tile-sketch",
        ),
        (
            H2oConfig {
                coverage: 0.9,
                ..hybrid
            },
            "--h2o-coverage",
        ),
    ] {
        let err = p.start_prompt(1, &prompts[0], Some(other)).unwrap_err();
        assert!(err.to_string().contains(flag), "{err}");
    }
}

#[test]
fn bad_sequences_and_prompts_are_errors() {
    let m = common::model();
    let mut p = ParallelSession::new(m, config(h2o()), 2).unwrap();
    let err = p.start_prompt(2, &[1, 2, 3], None).unwrap_err();
    assert!(
        err.to_string().contains("sequence 2 of a session with 2"),
        "{err}"
    );
    assert!(matches!(
        p.start_prompt(0, &[], None),
        Err(Error::EmptyPrompt)
    ));
    let long = vec![1; 1025];
    assert!(matches!(
        p.start_prompt(0, &long, None),
        Err(Error::PromptTooLong { n_ctx: 1024, .. })
    ));
    p.start_prompt(0, &[1, 2, 3], None).unwrap();
    p.prefill(0, &[1, 2, 3], usize::MAX).unwrap();
    // a next prompt replaces what the sequence holds: it may use the whole context
    assert!(p.start_prompt(0, &vec![1; 1024], None).unwrap() <= 1);
    let err = p.decode(&[(0, 5), (0, 6)]).unwrap_err();
    assert!(err.to_string().contains("twice"), "{err}");
    assert!(ParallelSession::new(m, config(h2o()), 0).is_err());
}

/// A server's prompt calls: one chunk at a time while other sequences generate, their decode
/// steps batched with this sequence's; with the recommended selection (hybrid, sinks, a dense
/// tail of 64) the sequence still generates what a session alone generates.
#[test]
#[cfg(not(feature = "stock"))]
fn chunked_prompt_calls_among_generating_sequences_change_nothing() {
    let m = common::model();
    let h = Some(H2oConfig::new(16, 16));
    let text = "The ledger records that the harbour master counted the ships at dawn and wrote the number down. ";
    let mut p = ParallelSession::new(m, config(h), 2).unwrap();
    let other = m.tokenize(&text.repeat(20), true, false).unwrap();
    // a chat prompt of 176 tokens: its dense tail starts at 112, inside chunk 1 ([64, 128))
    let chat = |c: String| {
        let rendered = m
            .apply_chat_template(&[ChatMessage::new("user", c)], true)
            .unwrap();
        m.tokenize(&rendered, true, true).unwrap()
    };
    let prompt = chat(format!("{}The harbour master's count", text.repeat(9)));
    assert_eq!(prompt.len(), 176);
    // sequence 1 generates while sequence 0's prompt goes in, one chunk per step
    p.start_prompt(1, &other, None).unwrap();
    let mut done = 0;
    while done < other.len() {
        done += p.prefill(1, &other[done..], usize::MAX).unwrap();
    }
    let mut s1 = Sampler::new(&SamplerConfig::greedy()).unwrap();
    let mut next1 = p.sample_last(&mut s1);
    p.start_prompt(0, &prompt, None).unwrap();
    let mut s0 = Sampler::new(&SamplerConfig::greedy()).unwrap();
    let mut done = 0;
    let mut got = Vec::new();
    let mut next0 = None;
    while got.len() < N_PREDICT {
        if done < prompt.len() {
            done += p.prefill(0, &prompt[done..], 64).unwrap();
            if done == prompt.len() {
                next0 = Some(p.sample_last(&mut s0));
            }
        }
        let mut step = vec![(1, next1)];
        if let Some(t) = next0.take() {
            got.push(t);
            step.push((0, t));
        }
        p.decode(&step).unwrap();
        next1 = p.sample_at(&mut s1, 0);
        if step.len() == 2 {
            next0 = Some(p.sample_at(&mut s0, 1));
        }
    }
    assert_eq!(got, alone(&prompt, h)[..N_PREDICT.min(got.len())]);
}

#[test]
fn a_saved_sequence_loads_into_another_and_its_next_prompt_is_a_fresh_prefills() {
    let m = common::model();
    let all = &prompts()[0];
    let (first, next) = (&all[..200], &all[..300]);
    let mut p = ParallelSession::new(m, config(h2o()), 3).unwrap();
    // a prompt's rest, call by call
    let run = |p: &mut ParallelSession, seq: u32, rest: &[Token]| {
        let mut done = 0;
        while done < rest.len() {
            done += p.prefill(seq, &rest[done..], usize::MAX).unwrap();
        }
    };
    p.start_prompt(0, first, None).unwrap();
    run(&mut p, 0, first);
    let path = std::env::temp_dir().join(format!("h2o-seq-{}.bin", std::process::id()));
    let (saved, bytes) = p.save_seq(0, &path).unwrap();
    assert!(bytes > 0 && saved > 0 && saved <= first.len(), "{saved}");
    // with H2O, the chunks before the prompt's dense tail; all of it with full attention
    if h2o().is_some() {
        assert_eq!(saved % 64, 0);
    } else {
        assert_eq!(saved, first.len());
    }
    assert_eq!(p.load_seq(1, &path).unwrap(), (saved, Integrity::Verified));
    assert_eq!(p.tokens(1), &first[..saved]);
    // the restored sequence reuses what it holds; its logits are a fresh sequence's
    let kept = p.start_prompt(1, next, None).unwrap();
    assert_eq!(kept, saved, "the next prompt reuses the restored prefix");
    run(&mut p, 1, &next[kept..]);
    let restored = p.logits(None).unwrap().to_vec();
    p.start_prompt(2, next, None).unwrap();
    run(&mut p, 2, next);
    assert_eq!(restored, p.logits(None).unwrap(), "restored vs fresh");

    // refused, with the sequence unchanged: damaged, truncated, not a saved sequence, no such
    // file
    let file = std::fs::read(&path).unwrap();
    let mut flipped = file.clone();
    flipped[file.len() - 100] ^= 0x10;
    let cut = &file[..file.len() / 2];
    for (bytes, needle) in [
        (&flipped[..], "damaged"),
        (cut, "truncated ("),
        (&b"not a state"[..], "not a sequence saved by h2o-llama"),
    ] {
        std::fs::write(&path, bytes).unwrap();
        let e = p.load_seq(1, &path).unwrap_err();
        assert!(matches!(e, Error::StateLoad { .. }), "{e}");
        assert!(e.to_string().contains(needle), "{e}");
        assert!(e.to_string().contains("the sequence is unchanged"), "{e}");
        assert_eq!(p.tokens(1).len(), next.len());
    }
    let _ = std::fs::remove_file(&path);
    assert!(matches!(p.load_seq(1, &path), Err(Error::StateLoad { .. })));
}

#[test]
fn a_shifted_sequence_drops_tokens_and_goes_on_as_a_fresh_prefill_of_what_remains() {
    let m = common::model();
    let prompt = &prompts()[0];
    let mut p = ParallelSession::new(m, config(None), 1).unwrap();
    let mut greedy = Sampler::new(&SamplerConfig::greedy()).unwrap();
    p.start_prompt(0, prompt, None).unwrap();
    let mut done = 0;
    while done < prompt.len() {
        done += p.prefill(0, &prompt[done..], usize::MAX).unwrap();
    }
    // keep 4 tokens, drop 100: the cache keeps the rest at positions moved back by 100
    p.shift_context(0, 4, 100).unwrap();
    let remaining: Vec<Token> = prompt[..4].iter().chain(&prompt[104..]).copied().collect();
    assert_eq!(p.tokens(0), remaining.as_slice());
    let mut shifted = Vec::new();
    let mut next = p.sample_last(&mut greedy);
    for _ in 0..6 {
        shifted.push(next);
        p.decode(&[(0, next)]).unwrap();
        next = p.sample_at(&mut greedy, 0);
    }
    // the same tokens evaluated afresh: the keys llama.cpp re-rotated give the same greedy text
    assert_eq!(shifted, alone(&remaining, None)[..6]);

    for (keep, drop) in [(0, 0), (150, 150)] {
        let e = p.shift_context(0, keep, drop).expect_err("bad range");
        assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
    }
    if let Some(h2o) = h2o() {
        let mut p = ParallelSession::new(m, config(Some(h2o)), 1).unwrap();
        p.start_prompt(0, prompt, None).unwrap();
        p.prefill(0, &prompt[..200], usize::MAX).unwrap();
        let e = p.shift_context(0, 4, 100).expect_err("H2O keeps positions");
        assert!(e.to_string().contains("H2O"), "{e}");
    }
}

#[test]
fn sequences_of_a_unified_cache_share_its_cells() {
    let m = common::model();
    let prompt = &prompts()[0];
    let n = 300;
    assert!(prompt.len() >= n, "the test wants a prompt of {n} tokens");
    let shared = SessionConfig {
        n_ctx: 512,
        ..config(None)
    };
    let mut p = ParallelSession::with_unified_cache(m, shared, 2).unwrap();
    // one sequence may hold more than half of the cache, which per-sequence streams forbid
    assert_eq!(p.n_ctx_seq(), 512);
    p.start_prompt(0, &prompt[..n], None).unwrap();
    let mut done = 0;
    while done < n {
        done += p.prefill(0, &prompt[done..n], usize::MAX).unwrap();
    }
    let mut greedy = Sampler::new(&SamplerConfig::greedy()).unwrap();
    let first = p.sample_last(&mut greedy);
    assert_eq!(
        first,
        alone(&prompt[..n], None)[0],
        "the same first token as alone"
    );
    assert_eq!(p.unified_cells_free(), Some(512 - n));
    // the other sequence finds only what is left: its prompt fits a sequence but not the cache
    p.start_prompt(1, &prompt[..n], None).unwrap();
    let mut refused = None;
    let mut done = 0;
    while done < n {
        match p.prefill(1, &prompt[done..n], usize::MAX) {
            Ok(k) => done += k,
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    let e = refused.expect("two prompts of 300 tokens cannot share 512 cells");
    assert!(
        matches!(e, Error::Decode(h2o_llama::DecodeError::NoKvSlot)),
        "{e}"
    );
    // once the first lets its cells go, the second fits
    p.clear(0).unwrap();
    p.start_prompt(1, &prompt[..n], None).unwrap();
    let mut done = 0;
    while done < n {
        done += p.prefill(1, &prompt[done..n], usize::MAX).unwrap();
    }
    assert_eq!(p.sample_last(&mut greedy), first);

    let per_sequence = ParallelSession::new(m, config(None), 2).unwrap();
    assert_eq!(per_sequence.unified_cells_free(), None);
    if let Some(h2o) = h2o() {
        let e = ParallelSession::with_unified_cache(m, config(Some(h2o)), 2)
            .expect_err("H2O keeps its state per stream");
        assert!(e.to_string().contains("--kv-unified"), "{e}");
    }
}
