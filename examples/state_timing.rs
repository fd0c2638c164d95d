//! How long saving and loading a session's state takes, and what checksumming it costs: a prompt
//! of N tokens of the demo ledger with H2O on (L = H = 256, chunks of 1,024), then REPS rounds of
//! `save_state` to a file and `load_state` of it into a fresh session, medians printed as JSON.
//!
//!   cargo run --release --example state_timing -- [N] [REPS] [DIR]
//!
//! Uses the public API only, so that the same file times an older build (docs/library.md, "Saved states").

use std::path::PathBuf;
use std::time::Instant;

use h2o_llama::{default_model, demo, H2oConfig, Model, ModelParams, Session, SessionConfig};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let n: usize = args.first().map_or(Ok(16384), |a| a.parse())?;
    let reps: usize = args.get(1).map_or(Ok(5), |a| a.parse())?;
    let dir = args.get(2).map_or_else(std::env::temp_dir, PathBuf::from);
    let model = Model::load(
        default_model::ensure(|m| eprintln!("{m}"))?,
        &ModelParams::default(),
    )?;
    let config = SessionConfig {
        n_ctx: n as u32,
        n_batch: 4096,
        n_ubatch: 1024,
        h2o: Some(H2oConfig::new(256, 256)),
        ..SessionConfig::default()
    };
    let tokens = demo::prompt_tokens(&model, n)?;
    let mut session = Session::new(&model, config.clone())?;
    eprintln!("state_timing: prefill of {n} tokens");
    session.evaluate(&tokens)?;
    let path = dir.join(format!("state-timing-{}.state", std::process::id()));
    let (mut save, mut load) = (Vec::new(), Vec::new());
    let mut bytes = 0;
    for rep in 0..reps {
        let t = Instant::now();
        session.save_state(&path)?;
        save.push(t.elapsed().as_secs_f64());
        bytes = std::fs::metadata(&path)?.len();
        let mut fresh = Session::new(&model, config.clone())?;
        let t = Instant::now();
        let _ = fresh.load_state(&path)?;
        load.push(t.elapsed().as_secs_f64());
        assert_eq!(fresh.n_past() as usize, n);
        eprintln!(
            "state_timing: rep {}/{reps}: save {:.3} s, load {:.3} s",
            rep + 1,
            save[rep],
            load[rep]
        );
    }
    std::fs::remove_file(&path)?;
    println!(
        "{{\"n_tokens\":{n},\"state_bytes\":{bytes},\"reps\":{reps},\"save_s\":{:.4},\"load_s\":{:.4}}}",
        median(save),
        median(load)
    );
    Ok(())
}
