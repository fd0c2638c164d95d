//! # h2o-llama
//!
//! llama.cpp with H2O chunked sparse prefill, from Rust.
//!
//! The crate builds a pinned llama.cpp with our patch series (see `patches/`), exposes its C API
//! as raw bindings in [`sys`], and wraps it in a safe API: a [`Model`], a [`Session`] owning a
//! context, a [`Sampler`], and [`default_model`] to fetch the small default model.
//!
//! ```no_run
//! use h2o_llama::{Model, ModelParams, Sampler, SamplerConfig, Session, SessionConfig};
//!
//! # fn main() -> Result<(), h2o_llama::Error> {
//! let path = h2o_llama::default_model::ensure(|msg| eprintln!("{msg}"))?;
//! let model = Model::load(&path, &ModelParams::default())?;
//! let mut session = Session::new(&model, SessionConfig::default())?;
//! let prompt = model.tokenize("The capital of France is", true, false)?;
//! let mut sampler = Sampler::new(&SamplerConfig::greedy())?;
//! let out = session.generate(&prompt, &mut sampler, 16, |piece| {
//!     print!("{piece}");
//!     true
//! })?;
//! eprintln!("\n{:.1} prompt tok/s", out.timings.prefill_tokens_per_second());
//! # Ok(())
//! # }
//! ```

pub mod sys;

mod backend;
mod cache_type;
pub mod capture;
mod chat;
#[cfg(not(feature = "stock"))]
mod chat_templates;
pub mod default_model;
pub mod demo;
mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod grammars;
mod model;
pub mod models;
pub mod rpc;
mod sampler;
mod session;

pub use backend::{gpu_offload_supported, set_log_echo};
pub use cache_type::CacheType;
pub use capture::{AttentionCapture, DecodeCapture};
pub use chat::ChatMessage;
#[cfg(not(feature = "stock"))]
pub use chat_templates::{
    ChatPrompt, ChatReply, ChatTemplateInfo, ChatTemplates, ReplyDelta, ReplyParser, ToolCall,
};
pub use error::{DecodeError, Error, ErrorKind, H2oError, Result};
pub use model::{FimTokens, Model, ModelParams, Token};
pub use sampler::{GrammarTriggers, Sampler, SamplerConfig, TokenLogprobs};
#[cfg(not(feature = "stock"))]
pub use session::engine_build_memory_set;
pub use session::{
    AbortCheck, FlashAttention, Generation, H2oConfig, H2oState, Integrity, MemorySet,
    ParallelSession, PromptCache, Selection, SeqId, Session, SessionConfig, Timings,
};

/// Version of the pinned upstream crate whose llama.cpp this library builds.
pub const UPSTREAM_VERSION: &str = env!("H2O_LLAMA_UPSTREAM_VERSION");

/// Whether this build applied the H2O patch series (false for the `stock` feature).
pub const PATCHED: bool = !cfg!(feature = "stock");
