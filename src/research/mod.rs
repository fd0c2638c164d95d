//! What measures and proves the engine rather than runs it: the plain-Rust reference of every
//! selection policy ([`reference`]) and the engine's rule against it ([`engine_rule`]), the
//! quality scoring behind `h2o-cli perplexity` ([`scoring`]), the long-context task suite
//! ([`eval`]), the prefill benchmark's schedule and report ([`bench`]), the studies of where the
//! attention is ([`coverage`]) and which tokens are kept ([`heavy_hitters`]), and the charts
//! ([`chart`], with the `charts` feature). The engine's own API is the crate's root.

pub mod bench;
#[cfg(feature = "charts")]
pub mod chart;
pub mod coverage;
#[cfg(not(feature = "stock"))]
pub mod engine_rule;
pub mod eval;
pub mod heavy_hitters;
pub mod reference;
pub mod scoring;
