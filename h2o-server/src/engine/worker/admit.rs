//! A queued job into a free slot: its prompt rendered and tokenized, the slot whose cache shares
//! the most with it, its memory selection and its sampler; a job that cannot start fails here
//! without taking a slot.

use std::sync::atomic::Ordering;
use std::time::Instant;

use h2o_llama::{ChatMessage, H2oConfig, Model, Sampler, SamplerConfig, Token};
use tokio::sync::mpsc::UnboundedSender;

use crate::engine::infill::infill_tokens;
use crate::engine::library_reason;

use super::super::{Event, Job, JobError, Metrics, Prompt, PromptPiece};
use super::{Active, Engine, Phase};

impl Engine<'_> {
    /// Gives queued jobs the free slots, in the order they came, each the slot it asked for
    /// (`id_slot`) or the one whose cached tokens share the longest prefix with its prompt (a
    /// conversation's next turn finds its previous one). A job for a busy slot waits for it.
    pub(super) fn assign_slots(&mut self) {
        while self.slots.iter().any(Option::is_none) {
            let startable = self.queue.iter().position(|(p, _)| {
                p.job
                    .id_slot
                    .is_none_or(|s| self.slots[s as usize].is_none())
            });
            let Some((pending, tx)) = startable.and_then(|i| self.queue.remove(i)) else {
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
            let slot = match pending.job.id_slot {
                Some(s) => s as usize,
                None => self.pick_slot(&prompt),
            };
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
            Prompt::Infill(infill) => {
                let plain = |text: &str| {
                    model
                        .tokenize(text, false, false)
                        .map_err(|e| JobError::Engine(e.to_string()))
                };
                return infill_tokens(
                    &model.fim_tokens(),
                    model.bos_token(),
                    &plain,
                    infill,
                    self.session.config().n_batch as usize,
                    self.session.n_ctx_seq() as usize,
                );
            }
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
