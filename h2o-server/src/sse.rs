//! Streamed answers as server-sent events, in the three shapes clients expect:
//! OpenAI's `chat.completion.chunk` and `text_completion` chunks ending with `data: [DONE]`, and
//! llama-server's `/completion` pieces ending with a `stop: true` event that holds the timings.
//!
//! The event stream owns the job's receiver: when the client goes away, hyper drops the body,
//! the receiver goes with it, and the engine cancels the job at its next step.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};

use crate::engine::Event;
use crate::error::{engine_gone, job_error, ApiError};
use crate::http::{llama_final, log_line, LoggedByStream, Output, Run};
use crate::openai::{
    ChatChunk, ChunkChoice, Delta, Head, LlamaChunk, TextChunk, TextChunkChoice, Usage,
};

/// Comments (`:`) every so often while nothing else is sent (a long prefill): they keep proxies
/// from closing an idle connection, and a write to a vanished client is how hyper notices it
/// and drops the stream, which cancels the job. Clients skip comment lines.
const KEEP_ALIVE: Duration = Duration::from_secs(5);

pub enum Format {
    Chat { head: Head, include_usage: bool },
    Text { head: Head, include_usage: bool },
    Llama { model: String },
}

impl Format {
    fn json(value: &impl serde::Serialize) -> SseEvent {
        // serde_json escapes control characters, so the data never holds a raw newline
        SseEvent::default().data(serde_json::to_string(value).unwrap_or_default())
    }

    /// What goes out before the first token.
    fn opening(&self) -> Option<SseEvent> {
        match self {
            // OpenAI's first chunk names the role, with empty content
            Format::Chat { head, .. } => Some(Self::json(&ChatChunk {
                head,
                choices: vec![ChunkChoice {
                    index: 0,
                    delta: Delta {
                        role: Some("assistant"),
                        content: Some(""),
                    },
                    finish_reason: None,
                    logprobs: None,
                }],
                usage: None,
                timings: None,
            })),
            Format::Text { .. } | Format::Llama { .. } => None,
        }
    }

    fn piece(&self, text: &str) -> SseEvent {
        match self {
            Format::Chat { head, .. } => Self::json(&ChatChunk {
                head,
                choices: vec![ChunkChoice {
                    index: 0,
                    delta: Delta {
                        role: None,
                        content: Some(text),
                    },
                    finish_reason: None,
                    logprobs: None,
                }],
                usage: None,
                timings: None,
            }),
            Format::Text { head, .. } => Self::json(&TextChunk {
                head,
                choices: vec![TextChunkChoice {
                    index: 0,
                    text,
                    finish_reason: None,
                    logprobs: None,
                }],
                usage: None,
                timings: None,
            }),
            Format::Llama { .. } => Self::json(&LlamaChunk {
                content: text,
                stop: false,
            }),
        }
    }

    /// The closing events: the finish reason (with our timings), OpenAI's usage chunk when the
    /// client asked for it, and `[DONE]`.
    fn finish(&self, out: &Output) -> Vec<SseEvent> {
        let usage = Usage::new(out.prompt_tokens, out.completion_tokens);
        let reason = out.finish.as_str();
        match self {
            Format::Chat {
                head,
                include_usage,
            } => {
                let mut events = vec![Self::json(&ChatChunk {
                    head,
                    choices: vec![ChunkChoice {
                        index: 0,
                        delta: Delta::default(),
                        finish_reason: Some(reason),
                        logprobs: None,
                    }],
                    usage: None,
                    timings: Some(&out.timings),
                })];
                if *include_usage {
                    events.push(Self::json(&ChatChunk {
                        head,
                        choices: vec![],
                        usage: Some(usage),
                        timings: None,
                    }));
                }
                events.push(SseEvent::default().data("[DONE]"));
                events
            }
            Format::Text {
                head,
                include_usage,
            } => {
                let mut events = vec![Self::json(&TextChunk {
                    head,
                    choices: vec![TextChunkChoice {
                        index: 0,
                        text: "",
                        finish_reason: Some(reason),
                        logprobs: None,
                    }],
                    usage: None,
                    timings: Some(&out.timings),
                })];
                if *include_usage {
                    events.push(Self::json(&TextChunk {
                        head,
                        choices: vec![],
                        usage: Some(usage),
                        timings: None,
                    }));
                }
                events.push(SseEvent::default().data("[DONE]"));
                events
            }
            // llama-server ends its stream with this event, without [DONE]
            Format::Llama { model } => vec![Self::json(&llama_final("", model, out))],
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
    queue: VecDeque<SseEvent>,
    ending: Ending,
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
            match self.run.next().await {
                Some(Event::Started { .. }) => {}
                Some(Event::Token { text, .. }) => {
                    if !text.is_empty() {
                        self.queue.push_back(self.format.piece(&text));
                    }
                }
                Some(Event::Done {
                    finish,
                    completion_tokens,
                    prompt_tokens,
                    timings,
                }) => {
                    let out = Output {
                        text: String::new(),
                        finish,
                        prompt_tokens,
                        completion_tokens,
                        timings,
                    };
                    self.queue.extend(self.format.finish(&out));
                    self.ending = Ending::Done;
                }
                // OpenAI clients raise an error for a data event holding {"error": …}; no [DONE]
                // follows, so none of them takes the text so far for a complete answer
                Some(Event::Failed(e)) => self.fail(&job_error(&e, self.run.prompt_param)),
                None => self.fail(&engine_gone()),
            }
        }
    }

    fn fail(&mut self, e: &ApiError) {
        self.queue
            .push_back(SseEvent::default().data(e.body().to_string()));
        self.ending = Ending::Failed(e.message.clone());
    }
}

/// The streamed response of `run`.
pub fn respond(run: Run, format: Format) -> Response {
    let mut state = StreamState {
        run,
        format,
        queue: VecDeque::new(),
        ending: Ending::Running,
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
