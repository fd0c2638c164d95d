//! Input of `scripts/decode-study.py` (not a check, hence ignored): the default model prefills
//! the first `DECODE_STUDY_N` tokens of `DECODE_STUDY_TEXT` (S = 1024, L = H = 256), then
//! decodes the next 16 tokens of the text with sparse decode, and each step's query and cache
//! of layers 2, 8, 14, 20 and 26 go to `DECODE_STUDY_DIR/s<step>_l<layer>.bin`: five u32 (n,
//! n_head, n_head_kv, head_dim, head_dim_v), the logit scale (f32), then Q, K and V as f32.
//!
//! ```text
//! DECODE_STUDY_TEXT=target/texts/techdoc.txt DECODE_STUDY_N=8064 \
//!     DECODE_STUDY_DIR=target/decode-study/techdoc \
//!     cargo test --release --test decode_study -- --ignored
//! ```
#![cfg(not(feature = "stock"))]

mod common;

use h2o_llama::{FlashAttention, H2oConfig, Session, SessionConfig};
use std::io::Write;

const STEPS: usize = 16;

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("set {name} (see this file's header)"))
}

#[test]
#[ignore = "writes the decode study's input; run by hand"]
fn write_decode_steps() {
    let m = common::model();
    let text = std::fs::read_to_string(var("DECODE_STUDY_TEXT")).unwrap();
    let tokens = m.tokenize(&text, true, false).unwrap();
    let n: usize = var("DECODE_STUDY_N").parse().unwrap();
    assert!(
        tokens.len() >= n + STEPS,
        "the text has {} tokens",
        tokens.len()
    );
    let mut s = Session::new(
        m,
        SessionConfig {
            n_ctx: (n + 64) as u32,
            n_batch: 4096,
            n_ubatch: 1024,
            n_threads: 2,
            flash_attn: FlashAttention::Off,
            capture_attention: true,
            h2o: Some(H2oConfig {
                decode_budget: 1024,
                ..H2oConfig::new(256, 256)
            }),
            ..SessionConfig::default()
        },
    )
    .unwrap();
    s.capture_only_layers(Some(vec![2, 8, 14, 20, 26])).unwrap();
    s.evaluate(&tokens[..n]).unwrap();
    s.take_attention_captures().unwrap();
    let dir = var("DECODE_STUDY_DIR");
    std::fs::create_dir_all(&dir).unwrap();
    for step in 0..STEPS {
        s.evaluate(&tokens[n + step..n + step + 1]).unwrap();
        for c in s.take_decode_captures().unwrap() {
            let path = format!("{dir}/s{step}_l{}.bin", c.layer);
            let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
            for x in [c.n, c.n_head, c.n_head_kv, c.head_dim, c.head_dim_v] {
                f.write_all(&x.to_le_bytes()).unwrap();
            }
            f.write_all(&c.scale.to_le_bytes()).unwrap();
            for x in c.q.iter().chain(&c.k).chain(&c.v) {
                f.write_all(&x.to_le_bytes()).unwrap();
            }
        }
    }
}
