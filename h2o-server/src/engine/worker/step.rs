//! A step of the engine: one prompt call of the slot whose job came first, then one decode step
//! of every generating slot; each sampled token's text out to its client, held back while it
//! may begin a stop string, and a job's end with llama-server's timings.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use h2o_llama::Token;

use super::super::{Event, FinishReason, JobError, JobTimings, Metrics};
use super::{Active, Engine, Phase};

impl Engine<'_> {
    /// One prompt call of one slot, then one decode step of all generating slots.
    pub(super) fn step(&mut self) {
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
