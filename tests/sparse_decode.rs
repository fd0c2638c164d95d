//! Sparse decode (`H2oConfig::decode_budget`) on the default model: with a budget
//! that covers the whole context, a decode step is full attention; with a small one, each step
//! reads its sinks, its recent window and the positions its query points at, and its next-token
//! distribution stays close to full attention's on the same cache; sequences decoding together
//! in one `ParallelSession` step get what each gets alone, each with its own sink and budget
//! too; bad budgets are refused by name.
#![cfg(not(feature = "stock"))]

mod common;

use h2o_llama::{Error, FlashAttention, H2oConfig, ParallelSession, Session, SessionConfig, Token};

const N_CTX: u32 = 2048;
const STEPS: usize = 12;

fn config(decode_budget: u32) -> SessionConfig {
    SessionConfig {
        n_ctx: N_CTX,
        n_batch: 2048,
        n_ubatch: 256,
        n_threads: 2,
        flash_attn: FlashAttention::Off,
        h2o: Some(H2oConfig {
            decode_budget,
            ..H2oConfig::new(64, 64)
        }),
        ..SessionConfig::default()
    }
}

/// A prompt of `n` tokens of varied text (a repeated paragraph would let any block stand for
/// any other): the pinned llama.cpp's README, which changes only with the pin.
fn prompt(n: usize) -> Vec<Token> {
    let m = common::model();
    let text =
        std::fs::read_to_string(concat!(env!("H2O_LLAMA_PRISTINE_DIR"), "/README.md")).unwrap();
    let tokens = m.tokenize(&text, true, false).unwrap();
    assert!(
        tokens.len() >= n,
        "llama.cpp's README.md is shorter than {n} tokens"
    );
    tokens[..n].to_vec()
}

fn softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = logits.iter().map(|&l| (f64::from(l - max)).exp()).collect();
    let z: f64 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}

/// KL(full || sparse) of two next-token distributions.
fn kld(full: &[f32], sparse: &[f32]) -> f64 {
    let (p, q) = (softmax(full), softmax(sparse));
    p.iter()
        .zip(&q)
        .filter(|(&p, _)| p > 0.0)
        .map(|(&p, &q)| p * (p / q.max(1e-300)).ln())
        .sum()
}

/// Steps of full-attention decode and of sparse decode after the same prompt, both fed the
/// full-attention greedy token (teacher forcing): (max |Δ logit|, mean KLD, top-1 agreements).
fn compare(prompt: &[Token], decode_budget: u32) -> (f32, f64, usize) {
    let m = common::model();
    let mut full = Session::new(m, config(0)).unwrap();
    let mut sparse = Session::new(m, config(decode_budget)).unwrap();
    full.evaluate(prompt).unwrap();
    sparse.evaluate(prompt).unwrap();
    // the prompt's own logits come from the prefill, which the budget does not touch
    assert_eq!(full.logits().unwrap(), sparse.logits().unwrap());
    let (mut max_diff, mut kl, mut agree) = (0.0_f32, 0.0, 0);
    let mut next = common::argmax(full.logits().unwrap()) as Token;
    for _ in 0..STEPS {
        full.evaluate(&[next]).unwrap();
        sparse.evaluate(&[next]).unwrap();
        let (f, s) = (full.logits().unwrap(), sparse.logits().unwrap());
        max_diff = max_diff.max(common::max_abs_diff(f, s));
        kl += kld(f, s);
        agree += usize::from(common::argmax(f) == common::argmax(s));
        next = common::argmax(f) as Token;
    }
    (max_diff, kl / STEPS as f64, agree)
}

/// The sparse decode op of every layer, captured, in the first step after a prompt of 1,000
/// tokens.
fn first_step_after_1000(config: SessionConfig) -> Vec<h2o_llama::DecodeCapture> {
    let m = common::model();
    let mut s = Session::new(m, config).unwrap();
    let p = prompt(1001);
    s.evaluate(&p[..1000]).unwrap();
    s.take_attention_captures().unwrap();
    s.evaluate(&p[1000..]).unwrap();
    let steps = s.take_decode_captures().unwrap();
    assert_eq!(steps.len() as u32, m.n_layer(), "one capture per layer");
    steps
}

/// The largest |Δ| of the captured step `c`'s output against the reference's (`out`, from
/// `reference::decode_step`), over every query head.
fn against_reference(c: &h2o_llama::DecodeCapture, out: &[f64]) -> f64 {
    assert_eq!(c.output.len(), out.len());
    c.output
        .iter()
        .zip(out)
        .map(|(&engine, &reference)| (f64::from(engine) - reference).abs())
        .fold(0.0, f64::max)
}

/// As [`config`], with the engine's attention ops captured.
fn capturing(decode_budget: u32) -> SessionConfig {
    SessionConfig {
        capture_attention: true,
        ..config(decode_budget)
    }
}

#[test]
fn a_budget_covering_the_context_decodes_as_full_attention() {
    let _engine = common::one_engine_at_a_time();
    // A step whose budget takes every position is full attention: on every layer, the op's
    // output against full attention in f64 over the same query and cache, and on the first layer
    // (where both see the same inputs) against the H2O prefill op's dense tail for the same token
    // (with a dense tail as long as the prompt, session B's last prompt token attends to
    // everything). Past the first layer the two sessions' inputs part: the sparse decode op sums
    // in another order than the prefill's tiles, and a difference of 1e-6 that moves one value
    // across a rounding step of the next layer's 8-bit activations grows from there.
    let m = common::model();
    let p = prompt(701);
    let (prefix, last) = p.split_at(700);
    let dense = |decode_budget: u32| SessionConfig {
        h2o: Some(H2oConfig {
            dense_tail: N_CTX,
            decode_budget,
            ..H2oConfig::new(64, 64)
        }),
        ..capturing(decode_budget)
    };
    // 640 positions of budget cover the 608 candidates of a step at 701, while the step's 768
    // cells (llama.cpp pads the cache view to 256) exceed the budget, the first block and the
    // window of 64 together, so that the op runs
    let mut a = Session::new(m, dense(640)).unwrap();
    a.evaluate(prefix).unwrap();
    a.take_attention_captures().unwrap();
    a.evaluate(last).unwrap();
    let steps = a.take_decode_captures().unwrap();
    assert_eq!(steps.len() as u32, m.n_layer(), "one capture per layer");
    let mut worst = 0.0_f64;
    for c in &steps {
        assert_eq!(c.n, 701);
        let every: Vec<Vec<usize>> = vec![(0..c.n as usize).collect(); c.n_head_kv as usize];
        let reference = h2o_research::reference::decode_attention(c, &every);
        for (&engine, &r) in c.output.iter().zip(&reference) {
            worst = worst.max((f64::from(engine) - r).abs());
        }
    }
    eprintln!(
        "sparse decode over every position vs full attention in f64: max |Δ out| {worst:.2e}"
    );
    assert!(worst < 1e-4, "max |Δ out| {worst}");

    let mut b = Session::new(m, dense(0)).unwrap();
    b.evaluate(&p).unwrap();
    let prefill = b.take_attention_captures().unwrap();
    let first = prefill.iter().rfind(|c| c.layer == 0).unwrap();
    let (n_head, dv) = (first.n_head as usize, first.head_dim_v as usize);
    let t = (700 - first.p0) as usize;
    let d = common::max_abs_diff(
        &first.output[t * n_head * dv..][..n_head * dv],
        &steps[0].output,
    );
    eprintln!("first layer, sparse decode vs the prefill's dense tail: max |Δ out| {d:.2e}");
    assert!(d < 1e-5, "max |Δ out| {d}");

    // and teacher-forced steps against llama.cpp's full-attention decode agree on every token
    let (max_diff, kl, agree) = compare(&prompt(700), 640);
    eprintln!("budget 640 over 712 positions vs llama.cpp's decode: max |Δ logit| {max_diff:.2}, KLD {kl:.2e}");
    assert!(agree >= STEPS - 1, "top-1 agreement {agree}/{STEPS}");
    assert!(kl < 0.01, "mean KLD {kl}");
}

#[test]
fn a_small_budget_reads_a_few_positions_and_stays_close_to_full_attention() {
    let _engine = common::one_engine_at_a_time();
    // 1600 prompt tokens; a step reads 16 sinks, 64 recent positions and 256 chosen: a fifth
    let p = prompt(1600);
    let (max_diff, kl, agree) = compare(&p, 256);
    eprintln!("budget 256 over 1612 positions: max |Δ logit| {max_diff:.3}, KLD {kl:.4}, top-1 {agree}/{STEPS}");
    assert!(
        max_diff > 1e-3,
        "a fifth of the keys cannot give full attention's logits exactly"
    );
    assert!(kl < 0.15, "mean KLD {kl}");
    assert!(3 * agree >= 2 * STEPS, "top-1 agreement {agree}/{STEPS}");
    // the chosen positions carry the attention: 16 (the least budget) are much further off
    let (_, kl_one, _) = compare(&p, 16);
    eprintln!("budget 16: KLD {kl_one:.4}");
    assert!(
        kl_one > 2.0 * kl,
        "16 positions: KLD {kl_one}, 256 chosen: {kl}"
    );
}

/// Teacher-forced decode steps: `tokens` one at a time, the logits after each.
fn forced_steps(s: &mut Session<'_>, tokens: &[Token]) -> Vec<Vec<f32>> {
    tokens
        .iter()
        .map(|&t| {
            s.evaluate(&[t]).unwrap();
            s.logits().unwrap().to_vec()
        })
        .collect()
}

/// A session saved after sparse steps continues as one that never saved: the key sketches
/// travel in the state with the channels they were made on. Chosen again after a restore, the
/// channels would come from every position then in the cache instead of those of the first
/// sparse step, and the steps would read other positions.
#[test]
fn a_state_saved_after_sparse_steps_continues_exactly() {
    let _engine = common::one_engine_at_a_time();
    let m = common::model();
    let p = prompt(1700);
    // 1,600 prompt tokens (100 blocks), then 40 sparse steps (two more blocks sketched) before
    // the save, and 60 after it, across three more block boundaries
    let (prompt, before, after) = (&p[..1600], &p[1600..1640], &p[1640..]);
    let mut first = Session::new(m, config(256)).unwrap();
    first.evaluate(prompt).unwrap();
    forced_steps(&mut first, before);
    assert!(
        first.decode_keys_per_step(prompt.len()) < 1000.0,
        "the steps before the save were not sparse"
    );
    let bytes = first.state_bytes().unwrap();
    let want = forced_steps(&mut first, after);

    let mut loaded = Session::new(m, config(256)).unwrap();
    loaded.load_state_bytes(&bytes).unwrap();
    assert_eq!(loaded.n_past(), 1640);
    let got = forced_steps(&mut loaded, after);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            g == w,
            "step {i} after the restore: max |Δ logit| {} against the session that never saved",
            common::max_abs_diff(g, w)
        );
    }

    // a context decoding in full reads the same state with the sketches skipped, saves it
    // without them, and continues from either file alike
    let mut full = Session::new(m, config(0)).unwrap();
    full.load_state_bytes(&bytes).unwrap();
    assert_eq!(full.n_past(), 1640);
    let resaved = full.state_bytes().unwrap();
    assert!(
        resaved.len() < bytes.len(),
        "a context decoding in full saved {} bytes, the sparse one {}",
        resaved.len(),
        bytes.len()
    );
    let mut again = Session::new(m, config(0)).unwrap();
    again.load_state_bytes(&resaved).unwrap();
    assert!(forced_steps(&mut full, &after[..8]) == forced_steps(&mut again, &after[..8]));
}

#[test]
fn sequences_decoding_together_get_what_each_gets_alone() {
    let _engine = common::one_engine_at_a_time();
    let m = common::model();
    let prompts = [prompt(900), prompt(1300)[400..].to_vec()];
    let config = SessionConfig {
        n_ctx: N_CTX,
        ..config(256)
    };
    // each alone: its logits after three teacher-forced steps
    let forced: Vec<Token> = vec![11, 12, 13];
    let alone: Vec<Vec<f32>> = prompts
        .iter()
        .map(|p| {
            let mut s = Session::new(m, config.clone()).unwrap();
            s.evaluate(p).unwrap();
            for &t in &forced {
                s.evaluate(&[t]).unwrap();
            }
            s.logits().unwrap().to_vec()
        })
        .collect();
    // together: one ParallelSession, both sequences in each decode step
    let mut p = ParallelSession::new(m, config, 2).unwrap();
    for (seq, prompt) in prompts.iter().enumerate() {
        p.start_prompt(seq as u32, prompt, None).unwrap();
        let mut done = 0;
        while done < prompt.len() {
            done += p.prefill(seq as u32, &prompt[done..], usize::MAX).unwrap();
        }
    }
    for &t in &forced {
        p.decode(&[(0, t), (1, t)]).unwrap();
    }
    for (i, alone) in alone.iter().enumerate() {
        let together = p.logits(Some(i)).unwrap();
        let d = common::max_abs_diff(alone, together);
        assert!(
            d < 1e-3,
            "sequence {i}: max |Δ logit| {d} between together and alone"
        );
    }
}

#[test]
fn each_sequence_decodes_with_its_own_sink_and_budget() {
    let _engine = common::one_engine_at_a_time();
    // a context with budget 256: sequence 0 asks for a sink of 20 and a budget of 64, sequence 1
    // keeps the context's, sequence 2 asks for full attention (0). Sequence 0 comes first in
    // each step, so a step that took its sink for every sequence would give sequence 1 two sink
    // blocks instead of one
    let m = common::model();
    let prompts = [
        prompt(900),
        prompt(1500)[800..].to_vec(),
        prompt(1300)[600..].to_vec(),
    ];
    let forced: Vec<Token> = vec![11, 12, 13];
    let own = |sink: u32, budget: u32| H2oConfig {
        sink,
        decode_budget: budget,
        ..H2oConfig::new(64, 64)
    };
    let context = own(H2oConfig::new(64, 64).sink, 256);
    let asks = [Some(own(20, 64)), None, Some(own(context.sink, 0))];
    // alone, each in a context of its own settings: sequence 2's 700 tokens with a budget of
    // 640 cover its 608 candidates in a view of 768 cells, so that the op runs and reads every
    // position, as a full-attention sequence does in a step the op runs for the others
    let alone: Vec<Vec<f32>> = [own(20, 64), context, own(context.sink, 640)]
        .iter()
        .zip(&prompts)
        .map(|(&h2o, prompt)| {
            let config = SessionConfig {
                h2o: Some(h2o),
                ..config(0)
            };
            let mut s = Session::new(m, config).unwrap();
            s.evaluate(prompt).unwrap();
            for &t in &forced {
                s.evaluate(&[t]).unwrap();
            }
            s.logits().unwrap().to_vec()
        })
        .collect();
    // with the undo log, as a server keeps it, so that a sequence can be cut back to a chunk
    let undo = SessionConfig {
        h2o_undo_log: true,
        ..config(256)
    };
    let mut p = ParallelSession::new(m, undo, 3).unwrap();
    for (seq, ask) in asks.iter().enumerate() {
        let seq = seq as u32;
        let prompt = &prompts[seq as usize];
        p.start_prompt(seq, prompt, *ask).unwrap();
        // a sketch left out is the context's, chosen for the model's key heads
        assert_eq!(p.h2o(seq), Some(ask.unwrap_or(context).for_model(m)));
        let mut done = 0;
        while done < prompt.len() {
            done += p.prefill(seq, &prompt[done..], usize::MAX).unwrap();
        }
    }
    for &t in &forced {
        p.decode(&[(0, t), (1, t), (2, t)]).unwrap();
    }
    for (i, alone) in alone.iter().enumerate() {
        let d = common::max_abs_diff(alone, p.logits(Some(i)).unwrap());
        assert!(
            d < 1e-3,
            "sequence {i}: max |Δ logit| {d} between its own settings together and alone"
        );
    }
    // the budget changes nothing the prompt built: the same prompt keeps its prefix (up to a
    // chunk boundary), where a change of selection would empty the sequence
    let kept = p.start_prompt(0, &prompts[0], Some(own(20, 128))).unwrap();
    assert!(kept >= 768, "kept {kept} of {} tokens", prompts[0].len());
    // emptied, a sequence decodes with the context's budget again
    p.clear(2).unwrap();
    assert_eq!(p.h2o(2).unwrap().decode_budget, 256);
    // budgets are checked by name, and sparse decode needs a context that keeps the sketches
    let e = p
        .start_prompt(2, &prompts[2], Some(own(context.sink, 8)))
        .expect_err("a budget below a block");
    assert!(e.to_string().contains("sparse decode budget"), "{e}");
    let mut full = ParallelSession::new(m, config(0), 2).unwrap();
    let e = full
        .start_prompt(0, &prompts[0], Some(own(context.sink, 64)))
        .expect_err("sparse decode without the sketches");
    assert!(e.to_string().contains("--h2o-decode sparse"), "{e}");
    full.start_prompt(0, &prompts[0], Some(own(context.sink, 0)))
        .unwrap();
}

#[test]
fn a_step_whose_cells_fit_in_the_budget_is_llama_cpps_own_attention() {
    let _engine = common::one_engine_at_a_time();
    // 700 prompt tokens in a cache view of 768 cells: a budget of 1024 with the first block and
    // the window would read them all, so the step runs llama.cpp's attention and its logits are
    // full decode's, bit for bit
    let (max_diff, kl, agree) = compare(&prompt(700), 1024);
    assert_eq!(max_diff, 0.0, "KLD {kl}");
    assert_eq!(agree, STEPS);
    let m = common::model();
    let mut s = Session::new(m, capturing(1024)).unwrap();
    s.evaluate(&prompt(700)).unwrap();
    s.take_attention_captures().unwrap();
    s.evaluate(&[11]).unwrap();
    assert!(
        s.take_decode_captures().unwrap().is_empty(),
        "no sparse decode op ran"
    );
}

#[test]
fn bad_budgets_are_refused_by_name() {
    let _engine = common::one_engine_at_a_time();
    let m = common::model();
    for (budget, names) in [
        (N_CTX + 16, "larger than the context"),
        (8, "smaller than one block"),
    ] {
        let e = Session::new(m, config(budget)).expect_err("a bad budget");
        assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
        let message = e.to_string();
        assert!(
            message.contains(names) && message.contains("--h2o-decode-budget"),
            "{message}"
        );
    }
}

#[test]
fn every_layer_of_a_choosing_step_matches_the_f64_reference() {
    let _engine = common::one_engine_at_a_time();
    // 1,000 prompt tokens, a budget of 128 positions (of about 870 candidates): each layer's
    // op, captured, against reference::decode_step's choice and attention in f64 (the reference
    // forms the 8-bit sketches, estimates and gaps in the engine's F32 operations, so it chooses
    // what the engine chooses, every KV head); and each KV head's sketch channels against the key
    // energy of the prompt's complete blocks
    let steps = first_step_after_1000(capturing(128));
    let mut worst = 0.0_f64;
    for c in &steps {
        assert_eq!(c.n, 1001);
        assert_eq!((c.local, c.budget), (64, 128));
        // the first step sketches the 62 complete blocks, its channels chosen from their keys
        assert_eq!(c.sketched_blocks, 62);
        let (d, n_head_kv) = (c.head_dim as usize, c.n_head_kv as usize);
        for kvh in 0..n_head_kv {
            let key = |pos: usize| &c.k[(pos * n_head_kv + kvh) * d..][..d];
            let energy = h2o_research::reference::channel_energy(key, 62 * 16, d);
            let chosen = &c.sketch_channels[kvh * (d / 4)..][..d / 4];
            assert!(chosen.windows(2).all(|w| w[0] < w[1]), "{chosen:?}");
            // every kept channel holds at least the energy of every channel left out (within
            // the engine's rounding)
            let kept_min = chosen
                .iter()
                .map(|&ch| energy[ch as usize])
                .fold(f64::INFINITY, f64::min);
            for (ch, &e) in energy.iter().enumerate() {
                if !chosen.contains(&(ch as u32)) {
                    assert!(
                        e <= kept_min * (1.0 + 1e-6),
                        "layer {} KV head {kvh}: channel {ch}",
                        c.layer
                    );
                }
            }
        }
        let (plans, out) = h2o_research::reference::decode_step(c);
        assert!(plans.iter().all(|p| p.chosen.len() == 128));
        worst = worst.max(against_reference(c, &out));
    }
    eprintln!("{} layers: max |Δ out| {worst:.2e}", steps.len());
    assert!(worst < 1e-4, "max |Δ out| {worst}");
}

#[test]
fn a_step_following_coverage_takes_what_the_reference_takes() {
    let _engine = common::one_engine_at_a_time();
    // 1,000 prompt tokens, a budget of 512 positions capped further by coverage 0.7: each
    // layer's op, captured, against reference::decode_step, which counts the candidates the
    // coverage takes from the engine's own gaps (buckets of the gaps' leading bits, integer
    // weights): the outputs agree, and the op's own count of the positions it read is the
    // reference's, on every layer
    let mut cfg = capturing(512);
    if let Some(h2o) = cfg.h2o.as_mut() {
        h2o.decode_coverage = 0.7;
    }
    let steps = first_step_after_1000(cfg);
    let mut worst = 0.0_f64;
    let (mut fewer, mut n_plans) = (0, 0);
    for c in &steps {
        assert_eq!((c.budget, c.coverage), (512, 0.7));
        let (plans, out) = h2o_research::reference::decode_step(c);
        for plan in &plans {
            assert!(plan.chosen.len() <= 512);
            fewer += usize::from(plan.chosen.len() < 512);
            n_plans += 1;
        }
        // the op's count, the mean over the KV heads
        let reference: usize = plans.iter().map(|p| p.positions(c.n as usize).len()).sum();
        let engine = c.keys_read.expect("the graph asks for the positions read");
        assert_eq!(
            engine,
            (reference as f64 / plans.len() as f64) as f32,
            "layer {}",
            c.layer
        );
        worst = worst.max(against_reference(c, &out));
    }
    eprintln!(
        "{} layers, {fewer} of {n_plans} KV heads took fewer than the budget: max |Δ out| \
         {worst:.2e}",
        steps.len()
    );
    assert!(worst < 1e-4, "max |Δ out| {worst}");
    // coverage 0.7 is a real cap on this text: most heads take fewer than the budget
    assert!(fewer * 2 > n_plans, "{fewer} of {n_plans} took fewer");
}

#[test]
fn a_lower_coverage_reads_fewer_keys_and_the_session_reports_them() {
    let _engine = common::one_engine_at_a_time();
    // the same prompt and steps at coverage 1, 0.9 and 0.6 (budget 512): the keys a step read,
    // as the session reports them, fall with the coverage; at 1 they are what the budget reads
    let m = common::model();
    let p = prompt(1201);
    let keys = |coverage: f32| {
        let mut cfg = config(512);
        if let Some(h2o) = cfg.h2o.as_mut() {
            h2o.decode_coverage = coverage;
        }
        let mut s = Session::new(m, cfg).unwrap();
        s.evaluate(&p[..1200]).unwrap();
        let mut next = common::argmax(s.logits().unwrap()) as Token;
        for _ in 0..4 {
            s.evaluate(&[next]).unwrap();
            next = common::argmax(s.logits().unwrap()) as Token;
        }
        s.decode_keys_per_step(1200)
    };
    let (all, most, some) = (keys(1.0), keys(0.9), keys(0.6));
    eprintln!("keys a step: coverage 1 {all:.1}, 0.9 {most:.1}, 0.6 {some:.1}");
    // coverage 1: 16 sinks, 512 chosen, the window from 1136 (a block boundary at or below
    // n - 64) to n, over steps seeing 1201 ..= 1204 positions
    assert_eq!(all, 16.0 + 512.0 + (1201.0 + 1204.0) / 2.0 - 1136.0);
    assert!(most < all && some < most, "{all} {most} {some}");
    assert!(
        some > 16.0 + (1201.0 - 1136.0),
        "at least the sinks and the window"
    );
}

#[test]
fn bad_coverages_are_refused_by_name() {
    let _engine = common::one_engine_at_a_time();
    let m = common::model();
    for (budget, coverage, names) in [
        (512, 0.0, "must be in (0, 1]"),
        (512, 1.5, "must be in (0, 1]"),
        (512, f32::NAN, "must be in (0, 1]"),
        (0, 0.9, "needs sparse decode"),
    ] {
        let mut cfg = config(budget);
        if let Some(h2o) = cfg.h2o.as_mut() {
            h2o.decode_coverage = coverage;
        }
        let e = Session::new(m, cfg).expect_err("a bad coverage");
        assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
        let message = e.to_string();
        assert!(
            message.contains(names) && message.contains("--h2o-decode-coverage"),
            "{message}"
        );
    }
}
