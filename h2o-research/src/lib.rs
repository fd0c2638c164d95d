//! # h2o-research
//!
//! What measures and proves the h2o-llama engine rather than runs it: the plain-Rust reference
//! of every selection policy ([`reference`]), the quality scoring behind `h2o-cli perplexity`
//! ([`scoring`]), the long-context task suite ([`eval`]), the prefill benchmark's schedule and
//! report ([`bench`]), the studies of where the attention is ([`coverage`]) and which tokens are
//! kept ([`heavy_hitters`]), and the charts ([`chart`], with the `charts` feature). It uses the
//! engine only through the `h2o_llama` crate's public API; a program that runs models needs only
//! that crate.

pub mod bench;
#[cfg(feature = "charts")]
pub mod chart;
pub mod coverage;
pub mod eval;
pub mod heavy_hitters;
pub mod reference;
pub mod scoring;
