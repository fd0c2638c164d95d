//! The server's Jinja chat templates, loaded with the model when the engine starts; rendering
//! requests through them is done by the HTTP side (the `jinja` module).

use std::sync::Arc;

use h2o_llama::ChatTemplates;

/// `--jinja`, `--no-jinja`, or neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JinjaMode {
    /// `--no-jinja`: built-in templates only; tools are refused.
    Off,
    /// The default: Jinja for requests with tools, built-in templates for the others.
    Tools,
    /// `--jinja`: Jinja for every chat request.
    All,
}

/// The server's Jinja templates, or why it has none.
#[derive(Debug, Clone)]
pub struct Jinja {
    pub mode: JinjaMode,
    pub templates: Result<Arc<ChatTemplates>, String>,
    /// `--reasoning-format`: what a request that leaves `reasoning_format` out gets (None:
    /// common/'s default).
    pub reasoning_format: Option<String>,
}
