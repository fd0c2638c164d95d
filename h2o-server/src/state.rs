//! What every request handler shares: the engine behind the [`Engine`] trait (so that the HTTP
//! layer's unit tests can run it against a scripted engine, with no model), the server's
//! [`Options`], and the counters the engine does not keep.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use h2o_llama::{ChatMessage, Token};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{
    EngineHandle, EngineInfo, Event, Job, JobError, Metrics, SlotOp, SlotOpDone, SlotOpError,
    SlotView, SubmitError,
};
use crate::response::Spell;

/// A slot operation's answer, boxed so that [`Engine`] stays a trait object.
pub type SlotOpFuture<'a> = std::pin::Pin<
    Box<dyn std::future::Future<Output = Result<SlotOpDone, SlotOpError>> + Send + 'a>,
>;

/// What the HTTP layer needs of the engine.
pub trait Engine: Send + Sync + 'static {
    /// # Errors
    /// As [`EngineHandle::submit`].
    fn submit(&self, job: Job) -> Result<UnboundedReceiver<Event>, SubmitError>;
    fn info(&self) -> &EngineInfo;
    /// The Jinja chat templates (`--jinja`, `--no-jinja`, tools).
    fn jinja(&self) -> &crate::jinja::Jinja;
    fn metrics(&self) -> &Metrics;
    fn slots(&self) -> Vec<SlotView>;
    /// As [`EngineHandle::slot_op`].
    fn slot_op(&self, id: u32, op: SlotOp) -> SlotOpFuture<'_>;
    /// The model's chat template applied to `messages`, with the assistant's turn opened
    /// (`POST /apply-template`): the Jinja template under `--jinja`, else llama.cpp's built-in
    /// one, as chat requests without tools are rendered.
    ///
    /// # Errors
    /// The template is not one llama.cpp knows, or a message has a NUL byte.
    fn apply_template(&self, messages: &[ChatMessage]) -> Result<String, JobError>;
    /// # Errors
    /// As [`EngineHandle::tokenize`].
    fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>, h2o_llama::Error>;
    /// # Errors
    /// As [`EngineHandle::token_piece`].
    fn token_piece(&self, token: Token) -> Result<Vec<u8>, h2o_llama::Error>;
    /// # Errors
    /// As [`EngineHandle::detokenize`].
    fn detokenize(&self, tokens: &[Token]) -> Result<String, h2o_llama::Error>;
}

impl Engine for EngineHandle {
    fn submit(&self, job: Job) -> Result<UnboundedReceiver<Event>, SubmitError> {
        EngineHandle::submit(self, job)
    }

    fn info(&self) -> &EngineInfo {
        EngineHandle::info(self)
    }

    fn jinja(&self) -> &crate::jinja::Jinja {
        EngineHandle::jinja(self)
    }

    fn metrics(&self) -> &Metrics {
        EngineHandle::metrics(self)
    }

    fn slots(&self) -> Vec<SlotView> {
        EngineHandle::slots(self)
    }

    fn slot_op(&self, id: u32, op: SlotOp) -> SlotOpFuture<'_> {
        Box::pin(EngineHandle::slot_op(self, id, op))
    }

    fn apply_template(&self, messages: &[ChatMessage]) -> Result<String, JobError> {
        crate::jinja::apply_template(self.jinja(), messages)
            .unwrap_or_else(|| self.render_builtin(messages))
    }

    fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<Token>, h2o_llama::Error> {
        EngineHandle::tokenize(self, text, add_special, parse_special)
    }

    fn token_piece(&self, token: Token) -> Result<Vec<u8>, h2o_llama::Error> {
        EngineHandle::token_piece(self, token)
    }

    fn detokenize(&self, tokens: &[Token]) -> Result<String, h2o_llama::Error> {
        EngineHandle::detokenize(self, tokens)
    }
}

/// Token spellings for the log-probability lists, from the engine's vocabulary.
pub struct EngineSpell(pub Arc<dyn Engine>);

impl Spell for EngineSpell {
    fn bytes(&self, token: Token) -> Vec<u8> {
        self.0.token_piece(token).unwrap_or_default()
    }
}

/// Server settings the endpoints follow, beside the engine's.
#[derive(Debug, Clone)]
pub struct Options {
    /// `--api-key`: every endpoint but the public ones wants the key.
    pub api_key: Option<String>,
    /// `--max-body`, in bytes.
    pub max_body: usize,
    /// `GET /slots` (off: 501, `--no-slots`).
    pub slots: bool,
    /// The page at `/` (off: 404, `--no-webui`).
    pub webui: bool,
    /// `--slot-save-path`: where `POST /slots/{id}?action=save|restore` keep their files
    /// (none: those answer 501).
    pub slot_save_path: Option<std::path::PathBuf>,
    /// `--verbose`: whole OpenAI answers carry llama-server's `__verbose`, the first choice's
    /// `/completion` answer (its prompt text among it), for debugging templates.
    pub verbose: bool,
}

impl Options {
    #[must_use]
    pub fn new(api_key: Option<String>, max_body: usize) -> Self {
        Self {
            api_key,
            max_body,
            slots: true,
            webui: true,
            slot_save_path: None,
            verbose: false,
        }
    }
}

pub struct AppState {
    pub engine: Arc<dyn Engine>,
    pub options: Options,
    /// Requests answered 503 because the queue was full (the engine never saw them).
    pub rejected_queue_full: AtomicU64,
}

impl AppState {
    pub fn new(engine: Arc<dyn Engine>, options: Options) -> Self {
        Self {
            engine,
            options,
            rejected_queue_full: AtomicU64::new(0),
        }
    }

    /// Token spellings through this state's engine.
    pub fn spell(&self) -> Arc<EngineSpell> {
        Arc::new(EngineSpell(Arc::clone(&self.engine)))
    }
}

pub type Shared = Arc<AppState>;
