//! How another application uses the library: load a model, open a session, stream a greedy
//! completion, reuse the session for a second prompt.
//!
//! ```text
//! cargo run --release --example complete -- "The tallest mountain on Earth is"
//! H2O_LLAMA_MODEL=/path/to/model.gguf cargo run --release --example complete -- "Hello"
//! ```

use std::io::Write;

use h2o_llama::{
    default_model, Model, ModelParams, Sampler, SamplerConfig, Session, SessionConfig,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let prompt = std::env::args().skip(1).collect::<Vec<_>>().join(" ");
    let prompt = if prompt.is_empty() {
        "The tallest mountain on Earth is".to_string()
    } else {
        prompt
    };

    let path = match std::env::var_os("H2O_LLAMA_MODEL") {
        Some(p) => p.into(),
        None => default_model::ensure(|msg| eprintln!("{msg}"))?,
    };
    let model = Model::load(&path, &ModelParams::default())?;
    let mut session = Session::new(
        &model,
        SessionConfig {
            n_ctx: 2048,
            ..SessionConfig::default()
        },
    )?;
    let mut sampler = Sampler::new(&SamplerConfig::greedy())?;

    for text in [prompt.as_str(), "A second, unrelated prompt:"] {
        session.reset();
        sampler.reset();
        let tokens = model.tokenize(text, true, true)?;
        print!("{text}");
        let out = session.generate(&tokens, &mut sampler, 32, |piece| {
            print!("{piece}");
            std::io::stdout().flush().is_ok()
        })?;
        println!();
        eprintln!(
            "[{} prompt tokens at {:.0} tok/s, {} generated at {:.0} tok/s]",
            out.timings.prompt_tokens,
            out.timings.prefill_tokens_per_second(),
            out.timings.generated_tokens,
            out.timings.decode_tokens_per_second()
        );
    }
    Ok(())
}
