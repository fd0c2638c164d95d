//! Typed errors of the safe layer. Variants mirror the C API's failure modes (for
//! `llama_decode`, one variant per documented return code) so callers can react to each.

use std::path::PathBuf;

/// Why `llama_decode` failed, one variant per return code documented in `llama.h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// 1: no KV-cache slot for the batch (context full).
    #[error("no KV-cache slot for the batch: the context is full (use a larger -c)")]
    NoKvSlot,
    /// 2: aborted by the abort callback.
    #[error("aborted")]
    Aborted,
    /// -1: invalid input batch.
    #[error("invalid input batch")]
    InvalidInput,
    /// -2: compute buffer allocation failed.
    #[error("failed to allocate the compute buffers")]
    Allocation,
    /// -3: the graph computation failed.
    #[error("graph computation failed")]
    Compute,
    /// Any other code.
    #[error("llama_decode returned {0}")]
    Other(i32),
}

impl DecodeError {
    /// Maps a non-zero `llama_decode` return code.
    #[must_use]
    pub fn from_code(code: i32) -> Self {
        match code {
            1 => Self::NoKvSlot,
            2 => Self::Aborted,
            -1 => Self::InvalidInput,
            -2 => Self::Allocation,
            -3 => Self::Compute,
            c => Self::Other(c),
        }
    }
}

/// Why an H2O introspection call failed, one variant per negative `llama_h2o_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum H2oError {
    /// `LLAMA_H2O_STATUS_DISABLED`: the session was created without H2O.
    #[error("the session has no H2O state: create it with an H2oConfig (--h2o-local/--h2o-heavy)")]
    Disabled,
    /// `LLAMA_H2O_STATUS_INVALID_LAYER`.
    #[error(
        "layer {layer} has no H2O state: {n_layer} layers have it (all of a dense model's, the \
         non-SWA ones of a sliding-window model; Session::h2o_layers lists them)"
    )]
    InvalidLayer { layer: u32, n_layer: u32 },
    /// `LLAMA_H2O_STATUS_INVALID_HEAD`.
    #[error("query head {head} does not exist: the model has heads 0..{n_head}")]
    InvalidHead { head: u32, n_head: u32 },
    /// `LLAMA_H2O_STATUS_INVALID_RANGE`.
    #[error("positions {start}..{end} are outside the cache (0..{kv_size})")]
    InvalidRange { start: u64, end: u64, kv_size: u32 },
    /// Any other code.
    #[error("llama_h2o call returned {0}")]
    Other(i32),
}

/// Every error of the library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("model file not found: {path} (pass an existing GGUF file with -m, or omit -m to use the default model)")]
    ModelNotFound { path: PathBuf },

    #[error("RPC server {server}: {reason}")]
    Rpc { server: String, reason: String },

    #[error("cannot read model file {path}: {source}")]
    ModelUnreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path} is not a GGUF model file ({why}); llama.cpp models are GGUF files, e.g. *.Q4_1.gguf")]
    NotGguf { path: PathBuf, why: String },

    #[error("llama.cpp could not load the model {path}: {reason}")]
    ModelLoad { path: PathBuf, reason: String },

    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    #[error("llama.cpp could not create a context: {reason}")]
    ContextInit { reason: String },

    #[error("the prompt is empty: give some text with -p or -f")]
    EmptyPrompt,

    /// The tokens already in the session (`n_past`), the prompt's and those to generate do not
    /// fit in `n_ctx`.
    #[error("{} tokens do not fit in the context of {n_ctx} (prompt {n_prompt}, to generate \
             {n_predict}, already in the session {n_past}): use a larger -c (the model was trained \
             with {n_ctx_train}), a shorter prompt or a smaller -n", .n_past + .n_prompt + .n_predict)]
    PromptTooLong {
        n_past: usize,
        n_prompt: usize,
        n_predict: usize,
        n_ctx: u32,
        n_ctx_train: u32,
    },

    #[error("the text contains a NUL byte at offset {0}, which llama.cpp cannot tokenize")]
    NulInText(usize),

    #[error("tokenization failed: {0}")]
    Tokenize(String),

    /// A token id the model's vocabulary does not have (llama.cpp would abort on it).
    #[error("token id {token} is outside the vocabulary (0..{n_vocab})")]
    InvalidToken { token: i32, n_vocab: usize },

    #[error("chat prompt: {0}")]
    ChatTemplate(String),

    #[error("decode failed: {0}")]
    Decode(#[from] DecodeError),

    #[error("interrupted")]
    Interrupted,

    #[error("H2O: {0}")]
    H2o(#[from] H2oError),

    #[error("{0}")]
    DefaultModel(String),

    #[error("llama.cpp returned no logits for token {0} of the batch")]
    MissingLogits(usize),

    #[error("attention capture: {0}")]
    Capture(String),

    #[error("cannot save the session state to {to}: {reason}")]
    StateSave { to: String, reason: String },

    /// `session` says what the session holds afterwards: a refusal before anything changed
    /// leaves it as it was; a state that failed part-way leaves it empty (never half loaded).
    #[error("cannot load the session state from {from}: {reason} ({session})")]
    StateLoad {
        from: String,
        reason: String,
        session: &'static str,
    },
}

/// Which kind of failure an [`Error`] is, for front ends that tell them apart (h2o-cli's and
/// h2o-server's exit codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The user stopped it.
    Interrupted,
    /// The model: missing, unreadable, not GGUF, rejected by llama.cpp, or the default model's
    /// download failed.
    Model,
    /// llama.cpp refused or failed while running (context creation, decode).
    Runtime,
    /// The input or the parameters.
    Input,
}

impl Error {
    /// Which kind of failure this is.
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Interrupted => ErrorKind::Interrupted,
            Error::ModelNotFound { .. }
            | Error::ModelUnreadable { .. }
            | Error::NotGguf { .. }
            | Error::ModelLoad { .. }
            | Error::DefaultModel(_) => ErrorKind::Model,
            Error::Decode(_) | Error::ContextInit { .. } => ErrorKind::Runtime,
            _ => ErrorKind::Input,
        }
    }
}

impl From<std::ffi::NulError> for Error {
    fn from(e: std::ffi::NulError) -> Self {
        Error::NulInText(e.nul_position())
    }
}

/// Result with the library's error.
pub type Result<T, E = Error> = std::result::Result<T, E>;
