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
    ChatMessage, ChatTemplates, H2oConfig, H2oState, Model, ModelParams, ParallelSession, Sampler,
    SamplerConfig, SessionConfig, Token, TokenLogprobs,
};
use tokio::sync::mpsc::UnboundedSender;

use crate::error::library_reason;
use crate::jinja::{Jinja, JinjaMode};

use super::{
    EngineConfig, EngineHandle, EngineInfo, Event, FinishReason, Job, JobError, JobTimings,
    Metrics, NextTokenView, Prompt, PromptPiece, SlotH2oView, SlotOp, SlotOpDone, SlotOpError,
    SlotView, SubmitError,
};

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
    let model = Arc::new(Model::load(
        &config.model_path,
        &ModelParams {
            n_gpu_layers: config.n_gpu_layers,
        },
    )?);
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
    let session_config = SessionConfig {
        n_ctx: n_slot_ctx,
        n_batch: config.n_batch,
        n_ubatch: config.n_ubatch,
        n_threads: config.n_threads,
        flash_attn: config.flash_attn,
        cache_type_k: config.cache_type_k,
        cache_type_v: config.cache_type_v,
        h2o: config.h2o,
        // a slot's next request cuts its sequence back to a chunk boundary inside the prompt
        h2o_undo_log: config.h2o.is_some_and(|h| h.is_enabled()),
        ..SessionConfig::default()
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
        let (n_tokens, n_bytes) = match op {
            SlotOp::Save(path) => self.session.save_seq(id, &path).map_err(failed)?,
            SlotOp::Restore(path) => {
                let n_tokens = self.session.load_seq(id, &path).map_err(failed)?;
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

    /// Gives queued jobs the free slots, each the slot whose cached tokens share the longest
    /// prefix with its prompt (a conversation's next turn finds its previous one).
    fn assign_slots(&mut self) {
        while self.slots.iter().any(Option::is_none) {
            let Some((pending, tx)) = self.queue.pop_front() else {
                return;
            };
            self.metrics.queue_len.fetch_sub(1, Ordering::SeqCst);
            let prompt = match self.tokenize(&pending.job.prompt) {
                Ok(p) => p,
                Err(e) => {
                    self.fail_unstarted(&tx, e);
                    continue;
                }
            };
            let slot = self.pick_slot(&prompt);
            let h2o = self.job_h2o(&pending.job);
            if !pending.job.cache_prompt {
                if let Err(e) = self.session.clear(slot as u32) {
                    self.fail_unstarted(&tx, JobError::Engine(e.to_string()));
                    continue;
                }
            }
            let kept = match self.session.start_prompt(slot as u32, &prompt, h2o) {
                Ok(k) => k,
                Err(h2o_llama::Error::PromptTooLong { n_ctx, .. }) => {
                    self.fail_unstarted(
                        &tx,
                        JobError::PromptTooLong {
                            n_prompt: prompt.len(),
                            n_ctx_slot: n_ctx,
                        },
                    );
                    continue;
                }
                Err(h2o_llama::Error::EmptyPrompt) => {
                    self.fail_unstarted(&tx, JobError::EmptyPrompt);
                    continue;
                }
                Err(e) => {
                    self.fail_unstarted(&tx, JobError::Engine(e.to_string()));
                    continue;
                }
            };
            let s = &pending.job.sampling;
            let mut logit_bias = s.logit_bias.clone();
            for (text, bias) in &s.logit_bias_text {
                match self.session.model().tokenize(text, false, false) {
                    Ok(tokens) => logit_bias.extend(tokens.into_iter().map(|t| (t, *bias))),
                    Err(e) => {
                        self.fail_unstarted(
                            &tx,
                            JobError::Sampling {
                                param: "logit_bias",
                                message: format!("logit_bias {text:?}: {e}"),
                            },
                        );
                        continue;
                    }
                }
            }
            let config = SamplerConfig {
                temperature: s.temperature,
                top_k: if s.temperature > 0.0 { s.top_k } else { 0 },
                top_p: s.top_p,
                seed: s.seed,
                logit_bias,
                grammar: s.grammar.as_ref().map(|(g, _)| g.clone()),
                grammar_triggers: s.grammar_triggers.clone(),
                grammar_prefill: s.grammar_prefill.clone(),
            };
            let sampler = match Sampler::for_model(self.session.model(), &config) {
                Ok(sm) => sm,
                Err(e) => {
                    let message = library_reason(e);
                    let param = match &s.grammar {
                        Some((_, param)) if message.contains("grammar") => *param,
                        _ => "logit_bias",
                    };
                    self.fail_unstarted(&tx, JobError::Sampling { param, message });
                    continue;
                }
            };
            let _ = tx.send(Event::Started {
                slot: slot as u32,
                prompt_tokens: prompt.len(),
                prompt: prompt.clone(),
            });
            Metrics::add(&self.metrics.prompt_tokens_cached_total, kept as u64);
            if pending.job.progress {
                // where the prompt starts: the reused prefix counts as processed
                let _ = tx.send(Event::Progress {
                    total: prompt.len(),
                    cache: kept,
                    processed: kept,
                    time_ms: 0.0,
                });
            }
            self.metrics.slots_busy.fetch_add(1, Ordering::SeqCst);
            let h2o_before = self.session.h2o_state(slot as u32);
            self.slots[slot] = Some(Active {
                tx,
                job: pending.job,
                phase: Phase::Prompt { done: kept },
                prompt,
                kept,
                sampler,
                generated: 0,
                pending_bytes: Vec::new(),
                held: String::new(),
                arrived: pending.arrived,
                prefill_start: Instant::now(),
                first_token: None,
                prefill_us: 0,
                h2o_before,
                unsent_tokens: Vec::new(),
                unsent_probs: Vec::new(),
                id_task: self.next_task,
                shifted: false,
            });
            self.next_task += 1;
        }
    }

    fn fail_unstarted(&self, tx: &UnboundedSender<Event>, e: JobError) {
        Metrics::add(&self.metrics.requests_total, 1);
        Metrics::add(&self.metrics.requests_failed, 1);
        let _ = tx.send(Event::Failed(e));
    }

    fn tokenize(&self, prompt: &Prompt) -> Result<Vec<Token>, JobError> {
        let model = self.session.model();
        let text = match prompt {
            Prompt::Text(t) => t.clone(),
            Prompt::Chat(messages) => render_chat(model, self.chat_template.as_deref(), messages)?,
            Prompt::Tokens(pieces) => return tokenize_pieces(model, pieces),
        };
        let tokens = model
            .tokenize(&text, true, true)
            .map_err(|e| JobError::Engine(e.to_string()))?;
        // empty and too long prompts: ParallelSession::start_prompt checks them
        Ok(tokens)
    }

    /// The free slot sharing the longest prefix with `prompt` (the lowest such index).
    fn pick_slot(&self, prompt: &[Token]) -> usize {
        (0..self.slots.len())
            .filter(|&s| self.slots[s].is_none())
            .max_by_key(|&s| {
                let cached = self.session.tokens(s as u32);
                let common = cached
                    .iter()
                    .zip(prompt)
                    .take_while(|(a, b)| a == b)
                    .count();
                (common, std::cmp::Reverse(s))
            })
            .expect("a free slot")
    }

    /// The memory selection a job asks for (`None`: the server's).
    fn job_h2o(&self, job: &Job) -> Option<H2oConfig> {
        let base = self.session.config().h2o.filter(H2oConfig::is_enabled)?;
        let o = &job.h2o;
        if o.is_empty() {
            return None;
        }
        Some(H2oConfig {
            select: o.select.unwrap_or(base.select),
            sink: o.sink.unwrap_or(base.sink),
            dense_tail: o.dense_tail.unwrap_or(base.dense_tail),
            decode_budget: o.decode_budget.unwrap_or(base.decode_budget),
            ..base
        })
    }

    /// One prompt call of one slot, then one decode step of all generating slots.
    fn step(&mut self) {
        let generating = self.slots.iter().any(|a| {
            matches!(
                a,
                Some(Active {
                    phase: Phase::Generating { .. },
                    ..
                })
            )
        });
        // prompts first come, first served: finishing the oldest prompt before the next one
        // starts gives each its first token as early as the ones ahead allow (taking turns
        // would hold every prompt back until the last of them is done)
        let next_prompt = (0..self.slots.len())
            .filter_map(|s| match &self.slots[s] {
                Some(
                    a @ Active {
                        phase: Phase::Prompt { .. },
                        ..
                    },
                ) => Some((a.arrived, s)),
                _ => None,
            })
            .min()
            .map(|(_, s)| s);
        if let Some(slot) = next_prompt {
            // one chunk while others wait for their next token; a whole call otherwise, or one
            // batch when its client follows the progress (llama-server reports each batch)
            let config = self.session.config();
            let limit = if generating {
                config.n_ubatch as usize
            } else if self.slots[slot].as_ref().is_some_and(|a| a.job.progress) {
                config.n_batch as usize
            } else {
                usize::MAX
            };
            self.prompt_call(slot, limit);
        }
        self.decode_step();
    }

    /// With one cache shared by the slots (`--kv-unified`), lets idle slots' cached tokens go,
    /// least recently used first, until `needed` cells are free, as llama-server frees a
    /// finished slot's: a request may use what the others leave, and prefix reuse gives way.
    fn make_room(&mut self, needed: usize) {
        let Some(mut free) = self.session.unified_cells_free() else {
            return;
        };
        let mut idle: Vec<(Instant, usize)> = (0..self.slots.len())
            .filter(|&s| self.slots[s].is_none() && !self.session.tokens(s as u32).is_empty())
            .map(|s| (self.last_used[s], s))
            .collect();
        idle.sort_unstable();
        for (_, s) in idle {
            if free >= needed {
                break;
            }
            free += self.session.tokens(s as u32).len();
            let _ = self.session.clear(s as u32);
        }
    }

    fn prompt_call(&mut self, slot: usize, limit: usize) {
        let Some(a) = self.slots[slot].as_ref() else {
            return;
        };
        let Phase::Prompt { done } = a.phase else {
            return;
        };
        let needed = (a.prompt.len() - done).min(limit);
        self.make_room(needed);
        let a = self.slots[slot].as_mut().expect("active slot");
        let t0 = Instant::now();
        // a prompt call is long: it stops as soon as its client has gone or the server stops
        let client = a.tx.clone();
        let stopping = Arc::clone(&self.stopping);
        let abort = move || client.is_closed() || stopping.load(Ordering::Relaxed);
        let rest = &a.prompt[done..];
        let result = self
            .session
            .prefill_with_abort(slot as u32, rest, limit, &abort);
        let a = self.slots[slot].as_mut().expect("active slot");
        let us = t0.elapsed().as_micros() as u64;
        a.prefill_us += us;
        Metrics::add(&self.metrics.prefill_us_total, us);
        match result {
            Ok(k) => {
                Metrics::add(&self.metrics.prompt_tokens_total, k as u64);
                let done = done + k;
                if a.job.progress {
                    let _ = a.tx.send(Event::Progress {
                        total: a.prompt.len(),
                        cache: a.kept,
                        processed: done,
                        time_ms: a.prefill_us as f64 / 1e3,
                    });
                }
                if done < a.prompt.len() {
                    a.phase = Phase::Prompt { done };
                    return;
                }
                a.first_token = Some(Instant::now());
                if a.job.sampling.max_tokens == 0 {
                    return self.finish(slot, FinishReason::Length);
                }
                let token = self.session.sample_last(&mut a.sampler);
                if let Some(logits) = self.session.logits(None) {
                    a.record_probs(logits, token);
                }
                self.take_token(slot, token);
            }
            Err(h2o_llama::Error::Interrupted) if a.tx.is_closed() => {
                self.release(slot);
                Metrics::add(&self.metrics.requests_cancelled, 1);
            }
            // the server is stopping: the next turn of the loop cancels every job
            Err(h2o_llama::Error::Interrupted) if self.stopping.load(Ordering::SeqCst) => {}
            Err(e) => self.fail(slot, JobError::Engine(e.to_string())),
        }
    }

    /// Decodes the sampled tokens of all generating slots in one `llama_decode`, and samples
    /// each slot's next.
    fn decode_step(&mut self) {
        let step: Vec<(u32, Token)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(s, a)| match a {
                Some(Active {
                    phase: Phase::Generating { next },
                    ..
                }) => Some((s as u32, *next)),
                _ => None,
            })
            .collect();
        if step.is_empty() {
            return;
        }
        self.make_room(step.len());
        let t0 = Instant::now();
        let stopping = Arc::clone(&self.stopping);
        let abort = move || stopping.load(Ordering::Relaxed);
        let result = self.session.decode_with_abort(&step, &abort);
        Metrics::add(
            &self.metrics.decode_us_total,
            t0.elapsed().as_micros() as u64,
        );
        match result {
            Ok(()) => {}
            // the server is stopping: the next turn of the loop cancels every job
            Err(h2o_llama::Error::Interrupted) if self.stopping.load(Ordering::SeqCst) => return,
            Err(e) => {
                for &(s, _) in &step {
                    self.fail(s as usize, JobError::Engine(e.to_string()));
                }
                return;
            }
        }
        for (i, &(s, _)) in step.iter().enumerate() {
            let a = self.slots[s as usize].as_mut().expect("generating slot");
            let token = self.session.sample_at(&mut a.sampler, i);
            if let Some(logits) = self.session.logits(Some(i)) {
                a.record_probs(logits, token);
            }
            self.take_token(s as usize, token);
        }
    }

    /// A token sampled for `slot`: ends the job (end of generation, stop string, `max_tokens`,
    /// a full slot) or sends its text and queues it for the next decode step.
    fn take_token(&mut self, slot: usize, token: Token) {
        let model = self.session.model();
        let n_ctx_slot = self.session.n_ctx_seq() as usize;
        let n_past = self.session.tokens(slot as u32).len();
        let a = self.slots[slot].as_mut().expect("active slot");
        if model.is_end_of_generation(token) {
            // the end-of-generation token is not part of the answer, nor are its probabilities
            a.unsent_probs.retain(|p| p.token != token);
            let flushed = std::mem::take(&mut a.held) + &String::from_utf8_lossy(&a.pending_bytes);
            a.pending_bytes.clear();
            send_text(a, flushed);
            return self.finish(slot, FinishReason::Stop);
        }
        a.generated += 1;
        a.unsent_tokens.push(token);
        Metrics::add(&self.metrics.generated_tokens_total, 1);
        let special = a.job.sampling.preserved_tokens.contains(&token);
        match model.token_bytes(token, special) {
            Ok(bytes) => a.pending_bytes.extend(bytes),
            Err(e) => return self.fail(slot, JobError::Engine(e.to_string())),
        }
        let valid = match std::str::from_utf8(&a.pending_bytes) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(), // incomplete tail: wait
            Err(_) => a.pending_bytes.len(),                      // invalid: lossy
        };
        let piece = String::from_utf8_lossy(&a.pending_bytes[..valid]).into_owned();
        a.pending_bytes.drain(..valid);
        a.held.push_str(&piece);
        let stops = &a.job.sampling.stop;
        if let Some(at) = stops.iter().filter_map(|s| a.held.find(s.as_str())).min() {
            let before = a.held[..at].to_string();
            a.held.clear();
            send_text(a, before);
            return self.finish(slot, FinishReason::StopWord);
        }
        // hold back a tail that may begin a stop string
        let keep = stops
            .iter()
            .map(|s| partial_stop(&a.held, s))
            .max()
            .unwrap_or(0);
        let out = a.held[..a.held.len() - keep].to_string();
        a.held.drain(..a.held.len() - keep);
        send_text(a, out);
        let limit_reached = a.generated >= a.job.sampling.max_tokens as usize;
        // the token goes into the sequence at the next decode step: it needs a free cell, which
        // a context shift makes
        let full = n_past >= n_ctx_slot;
        if full && !limit_reached && self.context_shift {
            let n_keep = match a.job.n_keep {
                -1 => a.prompt.len(),
                n => usize::try_from(n).unwrap_or(0),
            };
            let bos = usize::from(a.prompt.first() == model.bos_token().as_ref());
            // as llama-server: half of what follows the kept tokens goes
            let n_keep = (n_keep + bos).min(n_past.saturating_sub(2));
            let n_discard = (n_past - n_keep) / 2;
            if self
                .session
                .shift_context(slot as u32, n_keep as u32, n_discard as u32)
                .is_ok()
            {
                let a = self.slots[slot].as_mut().expect("active slot");
                a.shifted = true;
                a.phase = Phase::Generating { next: token };
                return;
            }
        }
        let a = self.slots[slot].as_mut().expect("active slot");
        if limit_reached || full {
            let rest = std::mem::take(&mut a.held) + &String::from_utf8_lossy(&a.pending_bytes);
            a.pending_bytes.clear();
            send_text(a, rest);
            let finish = if limit_reached {
                FinishReason::Length
            } else {
                FinishReason::ContextFull
            };
            return self.finish(slot, finish);
        }
        a.phase = Phase::Generating { next: token };
    }

    fn finish(&mut self, slot: usize, finish: FinishReason) {
        let Some(a) = self.release(slot) else {
            return;
        };
        Metrics::add(&self.metrics.requests_total, 1);
        let timings = self.timings(slot, &a);
        let _ = a.tx.send(Event::Done {
            finish,
            completion_tokens: a.generated,
            prompt_tokens: a.prompt.len(),
            timings,
        });
    }

    fn fail(&mut self, slot: usize, e: JobError) {
        if let Some(a) = self.release(slot) {
            Metrics::add(&self.metrics.requests_total, 1);
            Metrics::add(&self.metrics.requests_failed, 1);
            let _ = a.tx.send(Event::Failed(e));
        }
    }

    /// llama-server's timings of a finished job, and its H2O figures.
    fn timings(&self, slot: usize, a: &Active) -> JobTimings {
        let now = Instant::now();
        let first = a.first_token.unwrap_or(now);
        let prompt_n = a.prompt.len() - a.kept;
        let prompt_ms = first.duration_since(a.prefill_start).as_secs_f64() * 1e3;
        let predicted_n = a.generated;
        let predicted_ms = now.duration_since(first).as_secs_f64() * 1e3;
        let per = |n: usize, ms: f64| if n == 0 { 0.0 } else { ms / n as f64 };
        let rate = |n: usize, ms: f64| if ms <= 0.0 { 0.0 } else { n as f64 * 1e3 / ms };
        let (h2o_chunks, h2o_sparse_chunks, h2o_dense_tail_tokens, h2o_memory_size, h2o_policy) =
            match (
                self.session.h2o(slot as u32),
                self.session.h2o_state(slot as u32),
            ) {
                (Some(h), Some(st)) => {
                    let s = self.session.config().n_ubatch as usize;
                    let first_chunk = a.kept / s;
                    let last_chunk = (a.prompt.len() - 1) / s;
                    let chunks = (last_chunk + 1 - first_chunk) as u32;
                    // what llama.cpp counted while this job's prompt ran
                    let (sparse, tail) = st.counts_since(a.h2o_before.as_ref());
                    (
                        chunks,
                        sparse,
                        tail,
                        (h.local + h.heavy),
                        h.select.name().to_string(),
                    )
                }
                _ => (0, 0, 0, 0, "full".to_string()),
            };
        // decode steps ran after the prompt, one per generated token but the last
        let n_prompt = a.prompt.len() as u32;
        let h2o_decode_keys_per_step = self.session.decode_keys_per_step(
            slot as u32,
            n_prompt,
            n_prompt + predicted_n.saturating_sub(1) as u32,
        );
        JobTimings {
            prompt_n,
            prompt_ms,
            prompt_per_token_ms: per(prompt_n, prompt_ms),
            prompt_per_second: rate(prompt_n, prompt_ms),
            predicted_n,
            predicted_ms,
            predicted_per_token_ms: per(predicted_n, predicted_ms),
            predicted_per_second: rate(predicted_n.saturating_sub(1), predicted_ms),
            cache_n: a.kept,
            ttft_ms: first.duration_since(a.arrived).as_secs_f64() * 1e3,
            h2o_chunks,
            h2o_sparse_chunks,
            h2o_dense_tail_tokens,
            h2o_memory_size,
            h2o_policy,
            h2o_decode_keys_per_step,
            context_shifted: a.shifted,
        }
    }
}

/// Sends `text` with the tokens sampled since the last text went out (none goes out while
/// all text is held back: a stream's every piece has its text and its tokens).
fn send_text(a: &mut Active, text: String) {
    if !text.is_empty() {
        let _ = a.tx.send(Event::Token {
            text,
            tokens: std::mem::take(&mut a.unsent_tokens),
            probs: std::mem::take(&mut a.unsent_probs),
        });
    }
}

/// A conversation in the chat template (`--chat-template`'s, or the model's). A last message
/// from the assistant is a prefill, as in llama-server: the reply continues its text.
pub(crate) fn render_chat(
    model: &Model,
    template: Option<&str>,
    messages: &[ChatMessage],
) -> Result<String, JobError> {
    let render = |m: &[ChatMessage]| {
        model
            .apply_named_chat_template(template, m, true)
            .map_err(|e| JobError::Template(e.to_string()))
    };
    match messages.split_last() {
        Some((last, rest)) if last.role == "assistant" && !rest.is_empty() => {
            Ok(render(rest)? + &last.content)
        }
        _ => render(messages),
    }
}

/// A `prompt` array: token ids as they are, text tokenized in place (special tokens parsed;
/// the BOS only when the array starts with text, as a string prompt would get it).
fn tokenize_pieces(model: &Model, pieces: &[PromptPiece]) -> Result<Vec<Token>, JobError> {
    let mut tokens = Vec::new();
    for (i, piece) in pieces.iter().enumerate() {
        match piece {
            PromptPiece::Token(t) => tokens.push(*t),
            PromptPiece::Text(text) => tokens.extend(
                model
                    .tokenize(text, i == 0, true)
                    .map_err(|e| JobError::Engine(e.to_string()))?,
            ),
        }
    }
    model.check_tokens(&tokens).map_err(|e| {
        JobError::BadPrompt(format!(
            "prompt: {e}: send token ids of this model's vocabulary"
        ))
    })?;
    Ok(tokens)
}

/// The length of the longest suffix of `text` that is a proper prefix of `stop` (text that may
/// turn into `stop` with the next tokens), on a character boundary.
fn partial_stop(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k)
                && stop.is_char_boundary(k)
                && text.ends_with(&stop[..k])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::partial_stop;

    #[test]
    fn partial_stop_finds_the_tail_that_may_begin_a_stop_string() {
        assert_eq!(partial_stop("hello wor", "world"), 3);
        assert_eq!(partial_stop("hello", "world"), 0);
        assert_eq!(
            partial_stop("abc", "c"),
            0,
            "a whole stop string is not partial"
        );
        assert_eq!(partial_stop("x\u{e9}", "\u{e9}t"), 2);
    }
}
