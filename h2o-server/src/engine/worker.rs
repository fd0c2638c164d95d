//! The engine thread: owns the model and a [`ParallelSession`] with one sequence per slot, takes
//! jobs from a bounded queue, and runs the slots in steps. A step is one prompt call of the slot
//! whose job came first (at most one chunk, `n_ubatch` tokens, while other slots are generating,
//! so that a long prompt holds their tokens back by one chunk at a time) followed by one decode
//! step of every generating slot in a single `llama_decode` (continuous batching).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use h2o_llama::{
    ChatTemplates, H2oConfig, H2oState, Integrity, Model, ParallelSession, Sampler, SessionConfig,
    Token, TokenLogprobs,
};
use tokio::sync::mpsc::UnboundedSender;

use super::library_reason;

use super::{
    EngineConfig, EngineHandle, EngineInfo, Event, Jinja, JinjaMode, Job, JobError, Metrics,
    NextTokenView, SlotH2oView, SlotOp, SlotOpDone, SlotOpError, SlotView, SubmitError,
};

mod admit;
mod step;

pub(crate) use admit::render_chat;

pub(crate) enum Command {
    Submit(Box<Pending>, UnboundedSender<Event>),
    Slot(u32, SlotOp, SlotReply),
    Shutdown,
}

type SlotReply = tokio::sync::oneshot::Sender<Result<SlotOpDone, SlotOpError>>;

/// A job waiting for a slot.
pub(crate) struct Pending {
    job: Job,
    arrived: Instant,
}

/// Loads the model, creates the context and starts the engine thread; returns once the context
/// exists (or could not be made).
///
/// # Errors
/// The model or context could not be created, or the parameters are invalid.
pub fn start(config: EngineConfig) -> Result<EngineHandle, h2o_llama::Error> {
    if config.n_parallel == 0 {
        return Err(h2o_llama::Error::InvalidConfig(
            "-np must be at least 1".into(),
        ));
    }
    // shared with the HTTP layer, which tokenizes for /tokenize without waiting for a step
    let model = Arc::new(Model::load(&config.model_path, &config.model_params)?);
    let jinja = jinja_templates(&model, &config)?;
    let metrics = Arc::new(Metrics::default());
    let config_queue = config.queue_capacity;
    let chat_template = config.chat_template.clone();
    // jobs beyond the queue are refused in submit(); the channel has room for them and shutdown
    let (tx, rx) = std::sync::mpsc::sync_channel(config.queue_capacity + 16);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread_metrics = Arc::clone(&metrics);
    let thread_model = Arc::clone(&model);
    let stopping = Arc::new(AtomicBool::new(false));
    let thread_stopping = Arc::clone(&stopping);
    let slots = Arc::new(Mutex::new(Vec::new()));
    let thread_slots = Arc::clone(&slots);
    let thread = std::thread::Builder::new()
        .name("h2o-engine".into())
        .spawn(move || {
            let shared = Shared {
                metrics: thread_metrics,
                stopping: thread_stopping,
                slots: thread_slots,
            };
            run(&thread_model, config, rx, shared, ready_tx);
        })
        .map_err(|e| {
            h2o_llama::Error::InvalidConfig(format!("cannot start the engine thread: {e}"))
        })?;
    let info = ready_rx.recv().unwrap_or_else(|_| {
        Err(h2o_llama::Error::InvalidConfig(
            "the engine thread stopped while starting".into(),
        ))
    })?;
    Ok(EngineHandle {
        tx,
        stopping,
        model,
        info: Arc::new(info),
        metrics,
        slots,
        chat_template,
        jinja,
        queue_capacity: config_queue,
        thread: Arc::new(Mutex::new(Some(thread))),
    })
}

/// The Jinja templates (`--chat-template-file`'s, or the model's). Their failure stops the
/// server when `--jinja` or a template file asked for them; otherwise it is the answer to
/// requests with tools.
fn jinja_templates(model: &Arc<Model>, config: &EngineConfig) -> Result<Jinja, h2o_llama::Error> {
    let templates = match config.jinja {
        JinjaMode::Off => Err("--no-jinja".to_string()),
        JinjaMode::Tools | JinjaMode::All => {
            match ChatTemplates::new(Arc::clone(model), config.jinja_template.as_deref()) {
                Ok(t) => Ok(Arc::new(t)),
                Err(e) if config.jinja == JinjaMode::All || config.jinja_template.is_some() => {
                    return Err(h2o_llama::Error::InvalidConfig(format!(
                        "the Jinja chat template: {}",
                        library_reason(e)
                    )))
                }
                Err(e) => Err(e.to_string()),
            }
        }
    };
    Ok(Jinja {
        mode: config.jinja,
        templates,
        reasoning_format: config.reasoning_format.clone(),
    })
}

pub(crate) fn submit(
    handle: &EngineHandle,
    job: Job,
) -> Result<tokio::sync::mpsc::UnboundedReceiver<Event>, SubmitError> {
    if handle.stopping.load(Ordering::SeqCst) {
        return Err(SubmitError::ShuttingDown);
    }
    let capacity = handle.queue_capacity;
    let queued = handle.metrics.queue_len.fetch_add(1, Ordering::SeqCst) as usize;
    if queued >= capacity {
        handle.metrics.queue_len.fetch_sub(1, Ordering::SeqCst);
        return Err(SubmitError::QueueFull {
            queued,
            retry_after_s: 1,
        });
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let pending = Box::new(Pending {
        job,
        arrived: Instant::now(),
    });
    match handle.tx.try_send(Command::Submit(pending, tx)) {
        Ok(()) => Ok(rx),
        Err(e) => {
            handle.metrics.queue_len.fetch_sub(1, Ordering::SeqCst);
            match e {
                TrySendError::Full(_) => Err(SubmitError::QueueFull {
                    queued,
                    retry_after_s: 1,
                }),
                TrySendError::Disconnected(_) => Err(SubmitError::ShuttingDown),
            }
        }
    }
}

pub(crate) fn shutdown(handle: &EngineHandle) {
    // stops a llama_decode in progress; the command wakes an idle engine
    handle.stopping.store(true, Ordering::SeqCst);
    let _ = handle.tx.send(Command::Shutdown);
    let thread = handle.thread.lock().ok().and_then(|mut t| t.take());
    if let Some(thread) = thread {
        let _ = thread.join();
    }
}

/// What the engine thread shares with the handle.
struct Shared {
    metrics: Arc<Metrics>,
    /// Set by [`EngineHandle::shutdown`]: every job is cancelled, a running call included.
    stopping: Arc<AtomicBool>,
    /// `/slots`, refreshed at each step.
    slots: Arc<Mutex<Vec<SlotView>>>,
}

/// The engine thread: creates the context, reports it, then serves until shutdown.
fn run(
    model: &Model,
    config: EngineConfig,
    rx: Receiver<Command>,
    shared: Shared,
    ready: std::sync::mpsc::Sender<Result<EngineInfo, h2o_llama::Error>>,
) {
    let n_slot_ctx = match config.n_ctx {
        0 => 0,
        c if config.kv_unified => c,
        c => (c / config.n_parallel).max(1),
    };
    // -c 0 gives each slot the model's context, known only now
    let (session, h2o_auto) = match &config.session_if_short {
        Some(short) if !H2oConfig::automatic_for(model.n_ctx_train() as usize) => {
            let why = format!(
                "no slot holds a prompt long enough for it (the model's context of {} tokens \
                 each, H2O turns on by itself from {})",
                model.n_ctx_train(),
                H2oConfig::AUTO_FROM_TOKENS
            );
            (short, Some(h2o_flags::AutoDecision::left_off(&why)))
        }
        _ => (&config.session, config.h2o_auto.clone()),
    };
    let session_config = SessionConfig {
        n_ctx: n_slot_ctx,
        // a slot's next request cuts its sequence back to a chunk boundary inside the prompt
        h2o_undo_log: session.h2o.is_some_and(|h| h.is_enabled()),
        ..session.clone()
    };
    let session = if config.kv_unified {
        ParallelSession::with_unified_cache(model, session_config, config.n_parallel)
    } else {
        ParallelSession::new(model, session_config, config.n_parallel)
    };
    let session = match session {
        Ok(s) => s,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let model_file = config
        .model_path
        .file_name()
        .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
    let info = EngineInfo {
        model_id: config
            .aliases
            .iter()
            .min()
            .cloned()
            .unwrap_or_else(|| model_file.clone()),
        aliases: config.aliases.clone(),
        tags: config.tags.clone(),
        model_file,
        defaults: config.defaults,
        n_parallel: config.n_parallel,
        n_ctx_slot: session.n_ctx_seq(),
        n_ubatch: session.config().n_ubatch,
        flash_attn: session.config().flash_attn,
        h2o: session.config().h2o.filter(H2oConfig::is_enabled),
        h2o_auto,
        fim: model.fim_tokens(),
        n_vocab: model.n_vocab(),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    };
    // the slots are shown before the first request can ask for them
    let engine = Engine::new(session, shared, config.chat_template, config.context_shift);
    if ready.send(Ok(info)).is_err() {
        return;
    }
    engine.serve(&rx);
}

/// Where a slot's job is.
enum Phase {
    /// Evaluating `prompt[done..]`.
    Prompt { done: usize },
    /// Sampled `next`, which is not in the sequence yet.
    Generating { next: Token },
}

/// A job in a slot.
struct Active {
    tx: UnboundedSender<Event>,
    job: Job,
    prompt: Vec<Token>,
    kept: usize,
    phase: Phase,
    sampler: Sampler,
    generated: usize,
    /// Bytes of a character split across tokens, and text held back because it may begin a
    /// stop string.
    pending_bytes: Vec<u8>,
    held: String,
    arrived: Instant,
    prefill_start: Instant,
    first_token: Option<Instant>,
    prefill_us: u64,
    /// The slot's H2O state when its prompt started (with the reused prefix's counts), so that
    /// the job reports what llama.cpp counted while its own prompt ran.
    h2o_before: Option<H2oState>,
    /// Tokens sampled since the last text went out, and their log-probabilities (when asked).
    unsent_tokens: Vec<Token>,
    unsent_probs: Vec<TokenLogprobs>,
    /// The job's number, for `/slots`.
    id_task: u64,
    /// The slot's context was shifted to make room (`--context-shift`).
    shifted: bool,
}

impl Active {
    /// Keeps the log-probabilities of a sampled token when the job asked for them.
    fn record_probs(&mut self, logits: &[f32], token: Token) {
        let Some(n) = self.job.sampling.probs else {
            return;
        };
        self.unsent_probs
            .push(if self.job.sampling.post_sampling_probs {
                self.sampler.post_sampling_probs(logits, token, n)
            } else {
                TokenLogprobs::from_logits(logits, token, n)
            });
    }
}

struct Engine<'m> {
    session: ParallelSession<'m>,
    metrics: Arc<Metrics>,
    queue: VecDeque<(Box<Pending>, UnboundedSender<Event>)>,
    slots: Vec<Option<Active>>,
    /// Set by [`EngineHandle::shutdown`]: every job is cancelled, a running call included.
    stopping: Arc<AtomicBool>,
    views: Arc<Mutex<Vec<SlotView>>>,
    /// `--chat-template`: a built-in template's name or text in place of the model's.
    chat_template: Option<String>,
    /// `--context-shift`.
    context_shift: bool,
    next_task: u64,
    /// When each slot's last job ended (`make_room` lets the oldest cache go first).
    last_used: Vec<Instant>,
}

impl<'m> Engine<'m> {
    fn new(
        session: ParallelSession<'m>,
        shared: Shared,
        chat_template: Option<String>,
        context_shift: bool,
    ) -> Self {
        let n = session.n_seq() as usize;
        let this = Self {
            session,
            metrics: shared.metrics,
            queue: VecDeque::new(),
            slots: (0..n).map(|_| None).collect(),
            stopping: shared.stopping,
            views: shared.slots,
            chat_template,
            context_shift,
            next_task: 0,
            last_used: vec![Instant::now(); n],
        };
        this.publish_slots();
        this
    }

    /// Refreshes what `/slots` shows.
    fn publish_slots(&self) {
        let n_ctx = self.session.n_ctx_seq();
        let views: Vec<SlotView> = (0..self.slots.len())
            .map(|s| self.slot_view(s, n_ctx))
            .collect();
        *self
            .views
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = views;
    }

    fn slot_view(&self, slot: usize, n_ctx: u32) -> SlotView {
        let n_past = self.session.tokens(slot as u32).len();
        let Some(a) = &self.slots[slot] else {
            return SlotView {
                id: slot as u32,
                id_task: -1,
                n_ctx,
                n_past,
                ..SlotView::default()
            };
        };
        let processed = match a.phase {
            Phase::Prompt { done } => done,
            Phase::Generating { .. } => a.prompt.len(),
        };
        let h2o = self.session.h2o(slot as u32).map(|h| {
            let (sparse_chunks, dense_tail_tokens) = self
                .session
                .h2o_state(slot as u32)
                .map_or((0, 0), |st| st.counts_since(a.h2o_before.as_ref()));
            SlotH2oView {
                policy: h.select.name().to_string(),
                memory_size: h.local + h.heavy,
                local: h.local,
                heavy: h.heavy,
                prompt_tokens: a.prompt.len(),
                prompt_processed: processed,
                sparse_chunks,
                dense_tail_tokens,
                tokens_reused: a.kept,
            }
        });
        SlotView {
            id: slot as u32,
            id_task: a.id_task as i64,
            n_ctx,
            is_processing: true,
            n_past,
            next_token: NextTokenView {
                has_next_token: true,
                n_remain: i64::from(a.job.sampling.max_tokens) - a.generated as i64,
                n_decoded: a.generated,
            },
            h2o,
            sampling: Some(a.job.sampling.clone()),
        }
    }

    fn serve(mut self, rx: &Receiver<Command>) {
        loop {
            // wait for work when idle; otherwise only take what has arrived
            let idle = self.queue.is_empty() && self.slots.iter().all(Option::is_none);
            let first = if idle {
                match rx.recv_timeout(Duration::from_millis(500)) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => None,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            } else {
                None
            };
            for command in first.into_iter().chain(rx.try_iter()) {
                match command {
                    Command::Submit(p, tx) => self.queue.push_back((p, tx)),
                    Command::Slot(id, op, reply) => {
                        // publish before replying: a client that reads /slots right after the
                        // answer must see the operation's effect
                        let done = self.slot_op(id, op);
                        self.publish_slots();
                        let _ = reply.send(done);
                    }
                    Command::Shutdown => self.stopping.store(true, Ordering::SeqCst),
                }
            }
            if self.stopping.load(Ordering::SeqCst) {
                self.cancel_everything();
                return;
            }
            self.drop_cancelled();
            self.assign_slots();
            self.step();
            self.publish_slots();
        }
    }

    /// Ends every queued and running job (shutdown).
    fn cancel_everything(&mut self) {
        for (_, tx) in self.queue.drain(..) {
            self.metrics.queue_len.fetch_sub(1, Ordering::SeqCst);
            let _ = tx.send(Event::Failed(JobError::ShuttingDown));
        }
        for slot in 0..self.slots.len() {
            if let Some(a) = self.slots[slot].take() {
                let _ = a.tx.send(Event::Failed(JobError::ShuttingDown));
                Metrics::add(&self.metrics.requests_cancelled, 1);
            }
        }
        self.metrics.slots_busy.store(0, Ordering::SeqCst);
        self.publish_slots();
    }

    /// Saves, restores or erases a free slot's sequence.
    fn slot_op(&mut self, id: u32, op: SlotOp) -> Result<SlotOpDone, SlotOpError> {
        let n = self.slots.len() as u32;
        if id >= n {
            return Err(SlotOpError::NoSuchSlot { id, n });
        }
        if self.slots[id as usize].is_some() {
            return Err(SlotOpError::Busy(id));
        }
        let t0 = Instant::now();
        let failed = |e: h2o_llama::Error| SlotOpError::Failed(e.to_string());
        let mut unverified = false;
        let (n_tokens, n_bytes) = match op {
            SlotOp::Save(path) => self.session.save_seq(id, &path).map_err(failed)?,
            SlotOp::Restore(path) => {
                let (n_tokens, integrity) = self.session.load_seq(id, &path).map_err(failed)?;
                if integrity == Integrity::Unverified {
                    unverified = true;
                    eprintln!(
                        "h2o-server: warning: {} has no checksum (saved before checked state \
                         files): slot {id} was restored from it unchecked; saving it again adds one",
                        path.display()
                    );
                }
                let n_bytes = std::fs::metadata(&path).map_or(0, |m| m.len() as usize);
                (n_tokens, n_bytes)
            }
            SlotOp::Erase => {
                let n_tokens = self.session.tokens(id).len();
                self.session.clear(id).map_err(failed)?;
                (n_tokens, 0)
            }
        };
        Ok(SlotOpDone {
            n_tokens,
            n_bytes,
            ms: t0.elapsed().as_secs_f64() * 1e3,
            unverified,
        })
    }

    /// Frees the slots (and queue places) of jobs whose client has gone.
    fn drop_cancelled(&mut self) {
        let before = self.queue.len();
        self.queue.retain(|(_, tx)| !tx.is_closed());
        let gone = before - self.queue.len();
        if gone > 0 {
            self.metrics
                .queue_len
                .fetch_sub(gone as u64, Ordering::SeqCst);
            Metrics::add(&self.metrics.requests_cancelled, gone as u64);
        }
        for slot in 0..self.slots.len() {
            if self.slots[slot].as_ref().is_some_and(|a| a.tx.is_closed()) {
                self.release(slot);
                Metrics::add(&self.metrics.requests_cancelled, 1);
            }
        }
    }

    /// Takes a slot's job off it and shows the slot idle before the job's client hears its end:
    /// a client that reads `/slots` right after its answer sees the slot free.
    fn release(&mut self, slot: usize) -> Option<Active> {
        self.last_used[slot] = Instant::now();
        let a = self.slots[slot].take()?;
        self.metrics.slots_busy.fetch_sub(1, Ordering::SeqCst);
        self.publish_slots();
        Some(a)
    }
}
