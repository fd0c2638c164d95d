//! Streamed answers as server-sent events, in the three shapes clients expect:
//! OpenAI's `chat.completion.chunk` and `text_completion` chunks ending with `data: [DONE]`, and
//! llama-server's `/completion` pieces ending with a `stop: true` event that holds the timings.
//! The shapes themselves are `response`'s.
//!
//! The event stream owns the job's receiver: when the client goes away, hyper drops the body,
//! the receiver goes with it, and the engine cancels the job at its next step.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use h2o_llama::{ChatReply, ReplyDelta, ReplyParser, Token, TokenLogprobs};
use serde_json::Value;

use crate::engine::{EngineInfo, Event};
use crate::error::{engine_gone, job_error, ApiError};
use crate::log::{log_line, LoggedByStream};
use crate::response::{self, Head, LlamaShape, Output, Spell};
use crate::run::Run;

/// Comments (`:`) every so often while nothing else is sent (a long prefill): they keep proxies
/// from closing an idle connection, and a write to a vanished client is how hyper notices it
/// and drops the stream, which cancels the job. Clients skip comment lines.
const KEEP_ALIVE: Duration = Duration::from_secs(5);

pub enum Format {
    Chat {
        head: Head,
        include_usage: bool,
        logprobs: bool,
        /// A Jinja-rendered chat's reply parser: the stream sends what it parses (content,
        /// reasoning, tool call pieces) rather than the raw text.
        parser: Option<ReplyParser>,
    },
    Text {
        head: Head,
        include_usage: bool,
        logprobs: bool,
    },
    Llama {
        shape: LlamaShape,
        /// The answer's `generation_settings`.
        settings: Value,
        info: EngineInfo,
    },
}

impl Format {
    fn json(value: &Value) -> SseEvent {
        // serde_json escapes control characters, so the data never holds a raw newline
        SseEvent::default().data(value.to_string())
    }

    /// What goes out before the first token.
    fn opening(&self) -> Option<SseEvent> {
        match self {
            // llama-server's first chunk names the role, with null content
            Format::Chat { head, .. } => Some(Self::json(&response::chat_chunk(
                head,
                true,
                Some(None),
                None,
                None,
            ))),
            Format::Text { .. } | Format::Llama { .. } => None,
        }
    }

    fn piece(
        &self,
        text: &str,
        tokens: &[Token],
        probs: &[TokenLogprobs],
        spell: &dyn Spell,
        slot: Option<u32>,
        offset: usize,
    ) -> SseEvent {
        match self {
            Format::Chat { head, logprobs, .. } => Self::json(&response::chat_chunk(
                head,
                false,
                Some(Some(text)),
                None,
                logprobs.then(|| response::prob_list(spell, probs, false)),
            )),
            Format::Text { head, logprobs, .. } => Self::json(&response::text_chunk(
                head,
                text,
                None,
                logprobs.then(|| response::legacy_logprobs(spell, probs, offset)),
            )),
            Format::Llama { shape, .. } => Self::json(&response::llama_chunk(
                text, tokens, probs, shape, spell, slot,
            )),
        }
    }

    /// The closing events: the finish reason, OpenAI's usage chunk (with our timings) when the
    /// client asked for it, and `[DONE]`. `reply`: the whole answer as the parser split it.
    fn finish(
        &self,
        out: &Output,
        spell: &dyn Spell,
        prompt_text: &str,
        reply: Option<&ChatReply>,
    ) -> Vec<SseEvent> {
        let reason = out.finish_reason();
        match self {
            Format::Chat {
                head,
                include_usage,
                ..
            } => {
                let reason = response::chat_finish_reason(out, reply);
                let mut chunk = response::chat_chunk(head, false, None, Some(reason), None);
                chunk["timings"] = serde_json::json!(out.timings);
                let mut events = vec![Self::json(&chunk)];
                if *include_usage {
                    events.push(Self::json(&response::usage_chunk(head, out)));
                }
                events.push(SseEvent::default().data("[DONE]"));
                events
            }
            Format::Text {
                head,
                include_usage,
                ..
            } => {
                let mut chunk = response::text_chunk(head, "", Some(reason), None);
                chunk["timings"] = serde_json::json!(out.timings);
                let mut events = vec![Self::json(&chunk)];
                if *include_usage {
                    events.push(Self::json(&response::usage_chunk(head, out)));
                }
                events.push(SseEvent::default().data("[DONE]"));
                events
            }
            // llama-server ends its stream with this event, without [DONE]
            Format::Llama {
                shape,
                settings,
                info,
            } => {
                let shape = LlamaShape {
                    probs: false,
                    ..shape.clone()
                };
                vec![Self::json(&response::llama_final(
                    "",
                    out,
                    settings,
                    info,
                    &shape,
                    spell,
                    prompt_text,
                ))]
            }
        }
    }
}

/// Where a stream stands, for its log line.
#[derive(PartialEq)]
enum Ending {
    Running,
    Done,
    Failed(String),
}

struct StreamState {
    run: Run,
    format: Format,
    spell: Arc<dyn Spell + Send + Sync>,
    /// `return_progress`: `prompt_progress` events for the `/completion` stream.
    progress: bool,
    queue: VecDeque<SseEvent>,
    ending: Ending,
    /// What has gone out so far, for the closing event's counts and the text offsets.
    out: Output,
    /// Log-probabilities of tokens whose text the reply parser has not yet turned into a chunk.
    unsent_probs: Vec<TokenLogprobs>,
    /// The content the reply parser's pieces have sent.
    sent_content: String,
}

impl Drop for StreamState {
    /// The log line, written when the stream ends or the client leaves (hyper drops the body).
    fn drop(&mut self) {
        let (note, error) = match &self.ending {
            Ending::Running => (" stream (client disconnected)", None),
            Ending::Done => (" stream", None),
            Ending::Failed(e) => (" stream (failed)", Some(e.as_str())),
        };
        log_line(
            &self.run.request,
            StatusCode::OK,
            &self.run.stats,
            note,
            error,
        );
    }
}

impl StreamState {
    async fn next_event(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(e) = self.queue.pop_front() {
                return Some(e);
            }
            if self.ending != Ending::Running {
                return None;
            }
            let Some(event) = self.run.next().await else {
                self.fail(&engine_gone());
                continue;
            };
            self.out.record(&event);
            match event {
                Event::Started { .. } => {}
                Event::Progress {
                    total,
                    cache,
                    processed,
                    time_ms,
                } => {
                    if self.progress {
                        let chunk = match &self.format {
                            Format::Chat { head, .. } | Format::Text { head, .. } => {
                                response::openai_progress_chunk(
                                    head,
                                    response::prompt_progress(total, cache, processed, time_ms),
                                )
                            }
                            Format::Llama { .. } => {
                                response::progress_chunk(total, cache, processed, time_ms)
                            }
                        };
                        self.queue.push_back(Format::json(&chunk));
                    }
                }
                Event::Token {
                    text,
                    tokens,
                    probs,
                } => {
                    if let Format::Chat {
                        head,
                        logprobs,
                        parser: Some(parser),
                        ..
                    } = &mut self.format
                    {
                        self.unsent_probs.extend(probs);
                        // a reply cut where the format cannot yet tell what it is parses later
                        if let Ok((_, deltas)) = parser.update(&self.out.text, true) {
                            let logprobs = *logprobs;
                            let head = head.clone();
                            self.send_deltas(&head, &deltas, logprobs);
                        }
                    } else if !text.is_empty() {
                        // the text's offset: where it starts in what has gone out
                        let offset = self.out.text.len() - text.len();
                        let event = self.format.piece(
                            &text,
                            &tokens,
                            &probs,
                            self.spell.as_ref(),
                            self.out.slot,
                            offset,
                        );
                        self.queue.push_back(event);
                    }
                }
                Event::Done { .. } => {
                    let mut reply = None;
                    if let Format::Chat {
                        head,
                        logprobs,
                        parser: Some(parser),
                        ..
                    } = &mut self.format
                    {
                        // the last pieces: text held back while the reply was partial
                        let logprobs = *logprobs;
                        let head = head.clone();
                        match parser.update(&self.out.text, false) {
                            Ok((whole, deltas)) => {
                                self.send_deltas(&head, &deltas, logprobs);
                                reply = Some(whole);
                            }
                            // a reply the format does not take goes out as text, as the whole
                            // answer does: what the parser has not sent of it
                            Err(_) => {
                                if let Some(rest) = self.out.text.strip_prefix(&self.sent_content) {
                                    let delta = ReplyDelta {
                                        content: rest.to_string(),
                                        reasoning_content: String::new(),
                                        tool_call_index: None,
                                        tool_call: None,
                                    };
                                    if !rest.is_empty() {
                                        self.send_deltas(&head, &[delta], logprobs);
                                    }
                                }
                            }
                        }
                    }
                    let prompt_text = prompt_text(self.spell.as_ref(), &self.out.prompt);
                    let events = self.format.finish(
                        &self.out,
                        self.spell.as_ref(),
                        &prompt_text,
                        reply.as_ref(),
                    );
                    self.queue.extend(events);
                    self.ending = Ending::Done;
                }
                // OpenAI clients raise an error for a data event holding {"error": …}; no [DONE]
                // follows, so none of them takes the text so far for a complete answer
                Event::Failed(e) => self.fail(&job_error(&e, self.run.prompt_param)),
            }
        }
    }

    /// One chunk per parsed piece; the first carries the log-probabilities of the tokens since
    /// the last chunk.
    fn send_deltas(&mut self, head: &Head, deltas: &[ReplyDelta], logprobs: bool) {
        for d in deltas {
            self.sent_content.push_str(&d.content);
            let probs = std::mem::take(&mut self.unsent_probs);
            let chunk = response::chat_delta_chunk(
                head,
                response::reply_delta(d),
                None,
                logprobs.then(|| response::prob_list(self.spell.as_ref(), &probs, false)),
            );
            self.queue.push_back(Format::json(&chunk));
        }
    }

    fn fail(&mut self, e: &ApiError) {
        self.queue
            .push_back(SseEvent::default().data(e.body().to_string()));
        self.ending = Ending::Failed(e.message.clone());
    }
}

/// The prompt's text, special tokens included (llama-server's `prompt` field).
pub fn prompt_text(spell: &dyn Spell, prompt: &[Token]) -> String {
    let bytes: Vec<u8> = prompt.iter().flat_map(|&t| spell.bytes(t)).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The streamed response of `run`.
pub fn respond(
    run: Run,
    format: Format,
    spell: Arc<dyn Spell + Send + Sync>,
    progress: bool,
) -> Response {
    let mut state = StreamState {
        run,
        format,
        spell,
        progress,
        queue: VecDeque::new(),
        ending: Ending::Running,
        out: Output::default(),
        unsent_probs: Vec::new(),
        sent_content: String::new(),
    };
    if let Some(e) = state.format.opening() {
        state.queue.push_back(e);
    }
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        let event = s.next_event().await?;
        Some((Ok::<_, Infallible>(event), s))
    });
    let mut response = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response();
    response.extensions_mut().insert(LoggedByStream);
    response
}
