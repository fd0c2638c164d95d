//! A long-lived H2O session: one `Session` serves 50 prompts of mixed lengths — some within one
//! chunk, some spanning several, some follow-up turns of the conversation before — and must give
//! the same tokens as a fresh session replaying the conversation, while its resident memory
//! stays flat after the first few prompts.
//!
//! Its own test binary, so that no other test's allocations move the resident-memory figures.

mod common;

use std::collections::BTreeSet;

use h2o_llama::{demo, H2oConfig, Sampler, SamplerConfig, Session, SessionConfig, Token};

const PROMPTS: usize = 50;
/// Generated tokens per turn.
const N_PREDICT: usize = 6;
/// Prompt lengths, cycled; the longest fills several full batches.
const LENGTHS: [usize; 10] = [40, 128, 300, 90, 520, 257, 700, 15, 384, 1000];

fn config() -> SessionConfig {
    SessionConfig {
        n_ctx: 2048,
        n_batch: 512,
        n_ubatch: 128,
        n_threads: 2,
        h2o: Some(H2oConfig::seed(32, 32)),
        ..SessionConfig::default()
    }
}

/// Resident memory of this process, from /proc/self/statm (pages × 4 KiB).
fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// The conversations: each is a list of turns, each turn the tokens appended before generating.
/// Lengths cycle through one chunk and less (S = 128), a few chunks, and a misaligned tail; every
/// third conversation has a follow-up turn.
fn conversations(ledger: &[Token], followup: &[Token]) -> Vec<Vec<Vec<Token>>> {
    let mut out: Vec<Vec<Vec<Token>>> = Vec::new();
    let mut turns = 0;
    let mut i = 0;
    while turns < PROMPTS {
        let n = LENGTHS[i % LENGTHS.len()];
        // start each prompt at a different place in the ledger so that no two are alike
        let start = (i * 37) % (ledger.len() - n);
        let mut conversation = vec![ledger[start..start + n].to_vec()];
        turns += 1;
        if i % 3 == 2 && turns < PROMPTS {
            conversation.push(followup.to_vec());
            turns += 1;
        }
        out.push(conversation);
        i += 1;
    }
    out
}

fn serve(session: &mut Session<'_>, conversation: &[Vec<Token>]) -> Vec<Vec<Token>> {
    let mut sampler = Sampler::new(&SamplerConfig::greedy()).unwrap();
    conversation
        .iter()
        .map(|turn| {
            session
                .generate(turn, &mut sampler, N_PREDICT, |_| true)
                .unwrap()
                .tokens
        })
        .collect()
}

#[test]
fn one_session_serves_fifty_prompts_like_fresh_sessions_with_flat_memory() {
    let model = common::model();
    let ledger = demo::prompt_tokens(model, 1800).unwrap();
    let followup = model
        .tokenize("\nWhich crate was moved last, and by whom?\n", false, true)
        .unwrap();
    let conversations = conversations(&ledger, &followup);

    let mut session = Session::new(model, config()).unwrap();
    let mut served = Vec::new();
    let mut rss = Vec::new();
    for conversation in &conversations {
        session.reset();
        served.push(serve(&mut session, conversation));
        rss.extend(conversation.iter().map(|_| rss_bytes()));
    }
    assert_eq!(rss.len(), PROMPTS);
    let multi_chunk = conversations
        .iter()
        .filter(|c| c.iter().map(Vec::len).sum::<usize>() > 128)
        .count();
    let multi_turn = conversations.iter().filter(|c| c.len() > 1).count();
    assert!(multi_chunk >= 10 && multi_turn >= 10);

    let mut replayed = BTreeSet::new();
    // Replayed: every conversation with a follow-up turn (they take each of the ten lengths in
    // turn) and every one served right after such a conversation; a single-turn conversation
    // after a single-turn one checks nothing those do not.
    for (k, conversation) in conversations.iter().enumerate() {
        if k > 0 && conversation.len() == 1 && conversations[k - 1].len() == 1 {
            continue;
        }
        replayed.insert(conversation[0].len());
        let mut fresh = Session::new(model, config()).unwrap();
        assert_eq!(
            serve(&mut fresh, conversation),
            served[k],
            "conversation {k} (turn lengths {:?}) differs from a fresh session",
            conversation.iter().map(Vec::len).collect::<Vec<_>>()
        );
    }

    assert_eq!(
        replayed,
        BTreeSet::from(LENGTHS),
        "the replayed conversations begin with every length"
    );

    // The first prompt of each length touches buffer pages for the first time (a full batch of
    // 512 needs more of the compute buffer than one of 40); after one round of every length,
    // nothing new may be needed.
    let warm_up: usize = conversations[..LENGTHS.len()].iter().map(Vec::len).sum();
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let settled = rss[warm_up - 1];
    let peak_after = *rss[warm_up..].iter().max().unwrap();
    eprintln!(
        "resident memory: after prompt 1 {:.1} MiB, after {warm_up} (every length once) {:.1} MiB, highest after that {:.1} MiB, after {PROMPTS} {:.1} MiB",
        mib(rss[0]),
        mib(settled),
        mib(peak_after),
        mib(rss[PROMPTS - 1])
    );
    // Flat here to the page (184.0 MiB from prompt 6 on). The slack is one transparent huge
    // page (2 MiB) and some, for machines that back the heap with them; a leak of more than
    // about 80 KiB per prompt over the remaining 37 still fails it.
    assert!(
        peak_after <= settled + 3 * 1024 * 1024,
        "resident memory grew from {:.1} MiB after prompt {warm_up} to {:.1} MiB: {:?}",
        mib(settled),
        mib(peak_after),
        rss.iter()
            .map(|&b| (mib(b) * 10.0).round() / 10.0)
            .collect::<Vec<_>>()
    );
}
