//! The HTTP stack against a scripted engine: response shapes, streams as OpenAI clients parse
//! them, every error as an OpenAI error object, the API key, and cancellation when the client
//! goes away (the receiver must be dropped). No model needed; the real engine is covered by
//! `tests/http.rs`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::*;
use crate::engine::{
    EngineInfo, Event, FinishReason, Job, JobError, JobTimings, Metrics, Prompt, SlotView,
    SubmitError,
};
use crate::state::SlotOpFuture;
use h2o_llama::ChatMessage;

/// Scripted by the prompt text: "too long" fails at once with `PromptTooLong`; "engine error"
/// starts, sends one token and fails with `Engine`; "slow" sends a token every 20 ms (forever,
/// until cancelled); "hang" sends nothing until cancelled; anything else is "Hello world!" cut
/// at `max_tokens` pieces.
struct Fake {
    info: EngineInfo,
    metrics: Arc<Metrics>,
    /// Jobs allowed at once (running or queued) before `QueueFull`.
    capacity: usize,
    active: Arc<AtomicUsize>,
    /// Jobs whose receiver was dropped before they finished.
    cancelled: Arc<AtomicU64>,
    /// The last job submitted.
    last: std::sync::Mutex<Option<Job>>,
    /// No model, so no Jinja templates: requests with tools are 400.
    jinja: crate::jinja::Jinja,
}

impl Fake {
    fn new(capacity: usize) -> Self {
        Self {
            info: EngineInfo {
                model_id: "fake.gguf".into(),
                n_parallel: 2,
                n_ctx_slot: 512,
                n_ubatch: 64,
                flash_attn: h2o_llama::FlashAttention::Off,
                h2o: Some(h2o_llama::H2oConfig::new(16, 16)),
                h2o_auto: None,
                fim: h2o_llama::FimTokens::default(),
                created: 1_700_000_000,
                n_vocab: 256,
                aliases: Vec::new(),
                tags: Vec::new(),
                model_file: "m.gguf".into(),
                defaults: crate::engine::RequestDefaults::default(),
            },
            metrics: Arc::new(Metrics::default()),
            capacity,
            active: Arc::new(AtomicUsize::new(0)),
            cancelled: Arc::new(AtomicU64::new(0)),
            last: std::sync::Mutex::new(None),
            jinja: crate::jinja::Jinja {
                mode: crate::jinja::JinjaMode::Tools,
                templates: Err("the fake engine has no model".into()),
                reasoning_format: None,
            },
        }
    }
}

/// A piece of text as the engine sends it, one byte a token (the fake's vocabulary).
fn token_event(text: &str) -> Event {
    Event::Token {
        text: text.into(),
        tokens: text.bytes().map(h2o_llama::Token::from).collect(),
        probs: Vec::new(),
    }
}

fn prompt_text(job: &Job) -> String {
    match &job.prompt {
        Prompt::Text(t) => t.clone(),
        Prompt::Tokens(pieces) => pieces
            .iter()
            .map(|p| match p {
                crate::engine::PromptPiece::Token(t) => {
                    char::from(u8::try_from(*t).unwrap_or(b'?')).to_string()
                }
                crate::engine::PromptPiece::Text(t) => t.clone(),
            })
            .collect(),
        Prompt::Chat(m) => m
            .iter()
            .map(|m| m.content.as_str())
            .collect::<Vec<_>>()
            .join(" "),
        Prompt::Infill(i) => format!("{}<FILL>{}", i.prefix, i.suffix),
    }
}

impl Engine for Fake {
    fn jinja(&self) -> &crate::jinja::Jinja {
        &self.jinja
    }

    fn slots(&self) -> Vec<SlotView> {
        let busy = self.active.load(Ordering::SeqCst);
        (0..self.info.n_parallel)
            .map(|id| SlotView {
                id,
                is_processing: (id as usize) < busy,
                n_ctx: self.info.n_ctx_slot,
                ..SlotView::default()
            })
            .collect()
    }

    fn slot_op(&self, id: u32, _: crate::engine::SlotOp) -> SlotOpFuture<'_> {
        Box::pin(async move {
            Err(crate::engine::SlotOpError::NoSuchSlot {
                id,
                n: self.info.n_parallel,
            })
        })
    }

    fn apply_template(&self, messages: &[ChatMessage]) -> Result<String, JobError> {
        Ok(messages
            .iter()
            .map(|m| format!("<{}>{}", m.role, m.content))
            .collect())
    }

    fn submit(&self, job: Job) -> Result<UnboundedReceiver<Event>, SubmitError> {
        if self.active.load(Ordering::SeqCst) >= self.capacity {
            return Err(SubmitError::QueueFull {
                queued: self.capacity,
                retry_after_s: 0,
            });
        }
        *self.last.lock().unwrap() = Some(job.clone());
        self.active.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = unbounded_channel();
        let (active, cancelled, metrics) = (
            self.active.clone(),
            self.cancelled.clone(),
            self.metrics.clone(),
        );
        let text = prompt_text(&job);
        tokio::spawn(async move {
            Metrics::add(&metrics.slots_busy, 1);
            let prompt_tokens = text.split_whitespace().count();
            let timings = JobTimings {
                prompt_n: prompt_tokens,
                h2o_policy: "hybrid".into(),
                ..JobTimings::default()
            };
            let finished = async {
                if text.contains("too long") {
                    let _ = tx.send(Event::Failed(JobError::PromptTooLong {
                        n_prompt: 9999,
                        n_ctx_slot: 512,
                    }));
                    return true;
                }
                if text.contains("hang") {
                    tx.closed().await;
                    return false;
                }
                let _ = tx.send(Event::Started {
                    slot: 0,
                    prompt_tokens,
                    prompt: text.bytes().map(h2o_llama::Token::from).collect(),
                });
                if text.contains("engine error") {
                    let _ = tx.send(token_event("Hel"));
                    let _ = tx.send(Event::Failed(JobError::Engine(
                        "the GPU caught fire".into(),
                    )));
                    return true;
                }
                if text.contains("slow") {
                    loop {
                        if tx.send(token_event("tick ")).is_err() {
                            return false;
                        }
                        tokio::select! {
                            () = tokio::time::sleep(Duration::from_millis(20)) => {}
                            () = tx.closed() => return false,
                        }
                    }
                }
                let pieces = ["Hello", " world", "!"];
                let n = pieces.len().min(job.sampling.max_tokens as usize);
                for p in &pieces[..n] {
                    let _ = tx.send(token_event(p));
                }
                let finish = if n < pieces.len() {
                    FinishReason::Length
                } else {
                    FinishReason::Stop
                };
                let _ = tx.send(Event::Done {
                    finish,
                    completion_tokens: n,
                    prompt_tokens,
                    timings,
                });
                true
            }
            .await;
            if !finished {
                cancelled.fetch_add(1, Ordering::SeqCst);
            }
            metrics.slots_busy.fetch_sub(1, Ordering::SeqCst);
            active.fetch_sub(1, Ordering::SeqCst);
        });
        Ok(rx)
    }

    fn info(&self) -> &EngineInfo {
        &self.info
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// A byte tokenizer: token = byte, vocabulary 0..256.
    fn tokenize(
        &self,
        text: &str,
        _: bool,
        _: bool,
    ) -> Result<Vec<h2o_llama::Token>, h2o_llama::Error> {
        Ok(text.bytes().map(h2o_llama::Token::from).collect())
    }

    fn token_piece(&self, token: h2o_llama::Token) -> Result<Vec<u8>, h2o_llama::Error> {
        u8::try_from(token)
            .map(|b| vec![b])
            .map_err(|_| h2o_llama::Error::InvalidToken {
                token,
                n_vocab: 256,
            })
    }

    fn detokenize(&self, tokens: &[h2o_llama::Token]) -> Result<String, h2o_llama::Error> {
        let bytes = tokens
            .iter()
            .map(|&t| self.token_piece(t).map(|b| b[0]))
            .collect::<Result<Vec<u8>, _>>()?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

pub(super) struct TestServer {
    base: String,
    fake: Arc<Fake>,
    client: reqwest::Client,
}

pub(super) async fn serve(capacity: usize, api_key: Option<&str>, max_body: usize) -> TestServer {
    serve_with(capacity, Options::new(api_key.map(String::from), max_body)).await
}

pub(super) async fn serve_with(capacity: usize, options: Options) -> TestServer {
    serve_fake(Fake::new(capacity), options).await
}

async fn serve_fake(fake: Fake, options: Options) -> TestServer {
    let fake = Arc::new(fake);
    let state = Arc::new(AppState::new(fake.clone(), options));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router(state)).await.unwrap() });
    TestServer {
        base,
        fake,
        client: reqwest::Client::new(),
    }
}

impl TestServer {
    pub(super) async fn post(
        &self,
        path: &str,
        body: impl Into<reqwest::Body>,
    ) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.base))
            .body(body)
            .send()
            .await
            .unwrap()
    }

    async fn post_json(&self, path: &str, body: &Value) -> (StatusCode, Value) {
        let r = self.post(path, body.to_string()).await;
        let status = r.status();
        (status, r.json().await.unwrap())
    }

    /// Waits until `n` jobs have seen their receiver dropped and none is active. The bound is
    /// generous (a loaded machine schedules the fake engine's tasks late); the wait ends as soon
    /// as the state is seen.
    async fn wait_for_cancelled(&self, n: u64) {
        let start = std::time::Instant::now();
        while self.fake.cancelled.load(Ordering::SeqCst) < n
            || self.fake.active.load(Ordering::SeqCst) != 0
        {
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "the job was not cancelled within 120 s: its receiver is still alive"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

pub(super) fn user(content: &str) -> Value {
    json!([{"role": "user", "content": content}])
}

/// The `data:` payloads of an SSE body, as OpenAI's clients split it: events end with a blank
/// line, comment lines (`:`) are skipped.
fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

fn assert_error(status: StatusCode, body: &Value, want: StatusCode, kind: &str) {
    assert_eq!(status, want, "{body}");
    let e = &body["error"];
    assert_eq!(e["type"], kind, "{body}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert_eq!(
        e["code"],
        want.as_u16(),
        "llama-server's code: the status; {body}"
    );
}

#[tokio::test]
async fn a_chat_completion_has_openais_shape() {
    let s = serve(8, None, 1 << 20).await;
    let (status, body) = s
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": user("two words"), "temperature": 0, "model": "anything"}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "fake.gguf");
    assert!(body["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(body["choices"][0]["index"], 0);
    assert_eq!(
        body["choices"][0]["message"],
        json!({"role": "assistant", "content": "Hello world!"})
    );
    assert_eq!(body["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        body["usage"],
        json!({"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5})
    );
    assert_eq!(body["timings"]["prompt_n"], 2);
    assert_eq!(body["timings"]["h2o_policy"], "hybrid");

    let (_, body) = s
        .post_json(
            "/chat/completions",
            &json!({"messages": user("x"), "max_tokens": 2}),
        )
        .await;
    assert_eq!(body["choices"][0]["message"]["content"], "Hello world");
    assert_eq!(body["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn a_streamed_chat_reads_as_openai_chunks() {
    let s = serve(8, None, 1 << 20).await;
    let r = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("hi"), "stream": true, "stream_options": {"include_usage": true}}).to_string(),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()[header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let id = &chunks[0]["id"];
    assert!(id.as_str().unwrap().starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(&c["id"], id, "one id for the whole stream");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "Hello world!");
    let last_choice = &chunks[chunks.len() - 2]["choices"][0];
    assert_eq!(last_choice["finish_reason"], "stop");
    assert_eq!(last_choice["delta"], json!({}));
    assert!(chunks[chunks.len() - 2]["timings"].is_object());
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(usage_chunk["usage"]["total_tokens"], 4);
    assert!(chunks[..chunks.len() - 2]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));
}

#[tokio::test]
async fn completions_stream_text_chunks_and_llama_completion_its_own_events() {
    let s = serve(8, None, 1 << 20).await;
    let (status, body) = s
        .post_json(
            "/v1/completions",
            &json!({"prompt": "once upon", "max_tokens": 8}),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(body["object"], "text_completion");
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(body["choices"][0]["text"], "Hello world!");
    assert_eq!(body["usage"]["prompt_tokens"], 2);

    let r = s
        .post(
            "/v1/completions",
            json!({"prompt": "a", "stream": true}).to_string(),
        )
        .await;
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, "Hello world!");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );

    let (status, body) = s
        .post_json("/completion", &json!({"prompt": "a b c", "n_predict": 2}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(body["content"], "Hello world");
    assert_eq!(body["stop"], true);
    assert_eq!(body["stop_type"], "limit");
    assert_eq!(body["tokens_predicted"], 2);
    assert_eq!(body["tokens_evaluated"], 3);
    for field in [
        "prompt_n",
        "prompt_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_second",
        "ttft_ms",
    ] {
        assert!(
            body["timings"][field].is_number(),
            "timings.{field}: {body}"
        );
    }

    let r = s
        .post(
            "/completion",
            json!({"prompt": "a", "stream": true}).to_string(),
        )
        .await;
    let data = sse_data(&r.text().await.unwrap());
    let events: Vec<Value> = data
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let (last, pieces) = events.split_last().unwrap();
    assert!(pieces.iter().all(|e| e["stop"] == false));
    let text: String = pieces
        .iter()
        .map(|e| e["content"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Hello world!");
    assert_eq!(last["stop"], true);
    assert_eq!(last["stop_type"], "eos");
    assert!(last["timings"].is_object());
}

#[tokio::test]
async fn models_health_props_and_metrics() {
    let s = serve(8, None, 1 << 20).await;
    let models: Value = s
        .client
        .get(format!("{}/v1/models", s.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "fake.gguf");
    assert_eq!(models["data"][0]["object"], "model");
    let health: Value = s
        .client
        .get(format!("{}/health", s.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        health,
        json!({"status": "ok", "slots_idle": 2, "slots_busy": 0, "queue_length": 0})
    );
    let props: Value = s
        .client
        .get(format!("{}/props", s.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(props["total_slots"], 2);
    assert_eq!(props["h2o"]["select"], "coverage");
    let r = s
        .client
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .unwrap();
    assert!(r.headers()[header::CONTENT_TYPE]
        .to_str()
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    let text = r.text().await.unwrap();
    assert!(
        text.contains("# TYPE h2o_server_requests_total counter\n"),
        "{text}"
    );
    assert!(text.contains("h2o_server_slots 2\n"), "{text}");
}

#[tokio::test]
async fn every_bad_request_is_an_openai_error_object() {
    let s = serve(8, None, 4096).await;
    let chat = "/v1/chat/completions";
    let cases: Vec<(&str, reqwest::Body, u16, &str, Option<&str>)> = vec![
        (
            chat,
            "{\"messages\": [".into(),
            400,
            "invalid_request_error",
            None,
        ),
        (chat, "".into(), 400, "invalid_request_error", None),
        (chat, "[]".into(), 400, "invalid_request_error", None),
        (
            chat,
            "{} trailing".into(),
            400,
            "invalid_request_error",
            None,
        ),
        (
            chat,
            "{}".into(),
            400,
            "invalid_request_error",
            Some("messages"),
        ),
        (
            chat,
            json!({"messages": "hi"}).to_string().into(),
            400,
            "invalid_request_error",
            Some("messages"),
        ),
        (
            chat,
            json!({"messages": [{"content": "hi"}]}).to_string().into(),
            400,
            "invalid_request_error",
            Some("messages[0].role"),
        ),
        (
            chat,
            json!({"messages": []}).to_string().into(),
            400,
            "invalid_request_error",
            Some("messages"),
        ),
        (
            chat,
            json!({"messages": user("x"), "temperature": "hot"})
                .to_string()
                .into(),
            400,
            "invalid_request_error",
            Some("temperature"),
        ),
        (
            chat,
            json!({"messages": user("x"), "temperature": 9})
                .to_string()
                .into(),
            400,
            "invalid_request_error",
            Some("temperature"),
        ),
        (
            chat,
            json!({"messages": user("x"), "max_tokens": 1_000_000})
                .to_string()
                .into(),
            400,
            "invalid_request_error",
            Some("max_tokens"),
        ),
        (
            chat,
            json!({"messages": user("x"), "max_tokens": 1.5})
                .to_string()
                .into(),
            400,
            "invalid_request_error",
            Some("max_tokens"),
        ),
        (
            chat,
            json!({"messages": user("x"), "stream": "yes"})
                .to_string()
                .into(),
            400,
            "invalid_request_error",
            Some("stream"),
        ),
        (
            chat,
            json!({"messages": user("x"), "h2o_select": "nope"})
                .to_string()
                .into(),
            400,
            "invalid_request_error",
            Some("h2o_select"),
        ),
        (
            chat,
            json!({"messages": user("too long")}).to_string().into(),
            400,
            "exceed_context_size_error",
            Some("messages"),
        ),
        (
            chat,
            vec![b'{', b'"', 0xff, 0xfe, b'"', b'}'].into(),
            400,
            "invalid_request_error",
            None,
        ),
        (
            chat,
            format!(
                "{{\"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}]}}",
                "x".repeat(5000)
            )
            .into(),
            413,
            "invalid_request_error",
            None,
        ),
        (
            chat,
            json!({"messages": user("engine error")}).to_string().into(),
            500,
            "server_error",
            None,
        ),
        (
            "/v1/completions",
            json!({"prompt": ""}).to_string().into(),
            400,
            "invalid_request_error",
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 3}).to_string().into(),
            400,
            "invalid_request_error",
            Some("prompt"),
        ),
        (
            "/completion",
            json!({"prompt": "too long"}).to_string().into(),
            400,
            "exceed_context_size_error",
            Some("prompt"),
        ),
        (
            "/completion",
            json!({"prompt": "x", "n_predict": -7}).to_string().into(),
            400,
            "invalid_request_error",
            Some("n_predict"),
        ),
        ("/v1/nope", "{}".into(), 404, "not_found_error", None),
    ];
    for (path, body, status, kind, param) in cases {
        let r = s.post(path, body).await;
        let got = r.status();
        assert!(
            r.headers()[header::CONTENT_TYPE]
                .to_str()
                .unwrap()
                .starts_with("application/json"),
            "{path}"
        );
        let v: Value = r.json().await.unwrap();
        assert_error(got, &v, StatusCode::from_u16(status).unwrap(), kind);
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "{v}");
        }
    }
    let (_, v) = s
        .post_json(chat, &json!({"messages": user("too long")}))
        .await;
    assert_eq!(
        v["error"]["n_prompt_tokens"], 9999,
        "llama-server's fields: {v}"
    );
    assert_eq!(v["error"]["n_ctx"], 512, "{v}");
    let r = s
        .client
        .get(format!("{}{chat}", s.base))
        .send()
        .await
        .unwrap();
    let status = r.status();
    assert_error(
        status,
        &r.json().await.unwrap(),
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
    );
    // a prompt too long for a slot is a 400 even when streaming: the headers wait for it
    let r = s
        .post(
            chat,
            json!({"messages": user("too long"), "stream": true}).to_string(),
        )
        .await;
    assert_eq!(r.status(), 400);
    // nothing above disturbed the server
    let (status, _) = s.post_json(chat, &json!({"messages": user("fine")})).await;
    assert_eq!(status, 200);
    assert_eq!(s.fake.active.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn an_engine_failure_inside_a_stream_is_an_error_event_without_done() {
    let s = serve(8, None, 1 << 20).await;
    let r = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("engine error"), "stream": true}).to_string(),
        )
        .await;
    assert_eq!(r.status(), 200, "the failure came after the first event");
    let data = sse_data(&r.text().await.unwrap());
    assert!(!data.contains(&"[DONE]".to_string()));
    let last: Value = serde_json::from_str(data.last().unwrap()).unwrap();
    assert_eq!(last["error"]["type"], "server_error");
    assert!(last["error"]["message"]
        .as_str()
        .unwrap()
        .contains("caught fire"));
}

#[tokio::test]
async fn a_full_queue_is_a_503_with_retry_after() {
    let s = serve(1, None, 1 << 20).await;
    let busy = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("slow"), "stream": true}).to_string(),
        )
        .await;
    assert_eq!(busy.status(), 200);
    let r = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("x")}).to_string(),
        )
        .await;
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.headers()[header::RETRY_AFTER],
        "1",
        "never Retry-After: 0"
    );
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "unavailable_error");
    let metrics = s
        .client
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("h2o_server_requests_rejected_total 1\n"),
        "{metrics}"
    );
    drop(busy);
    s.wait_for_cancelled(1).await;
    let (status, _) = s
        .post_json("/v1/chat/completions", &json!({"messages": user("x")}))
        .await;
    assert_eq!(status, 200);
}

#[tokio::test]
async fn dropping_a_stream_cancels_its_job() {
    let s = serve(8, None, 1 << 20).await;
    let r = s
        .post(
            "/v1/chat/completions",
            json!({"messages": user("slow"), "stream": true}).to_string(),
        )
        .await;
    let mut body = r.bytes_stream();
    let first = body.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    assert_eq!(s.fake.cancelled.load(Ordering::SeqCst), 0);
    drop(body);
    s.wait_for_cancelled(1).await;
}

#[tokio::test]
async fn a_client_leaving_a_non_streamed_request_cancels_its_job() {
    let s = serve(8, None, 1 << 20).await;
    for prompt in ["slow", "hang"] {
        let before = s.fake.cancelled.load(Ordering::SeqCst);
        let r = s
            .client
            .post(format!("{}/v1/chat/completions", s.base))
            .body(json!({"messages": user(prompt)}).to_string())
            .timeout(Duration::from_millis(200))
            .send()
            .await;
        assert!(r.is_err(), "{prompt}: the request should time out");
        s.wait_for_cancelled(before + 1).await;
    }
}

#[tokio::test]
async fn an_api_key_guards_everything_but_health_and_the_model_list() {
    let s = serve(8, Some("sesame"), 1 << 20).await;
    let chat = format!("{}/v1/chat/completions", s.base);
    let body = json!({"messages": user("x")}).to_string();
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("sesame"),
        Some("Bearer sesam"),
    ] {
        let mut req = s.client.post(&chat).body(body.clone());
        if let Some(a) = auth {
            req = req.header(header::AUTHORIZATION, a);
        }
        // llama-server's other header, with a wrong key
        if auth == Some("sesame") {
            req = req.header("x-api-key", "sesam");
        }
        let r = req.send().await.unwrap();
        let status = r.status();
        let v: Value = r.json().await.unwrap();
        assert_error(status, &v, StatusCode::UNAUTHORIZED, "authentication_error");
    }
    let r = s
        .client
        .get(format!("{}/metrics", s.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = s
        .client
        .post(&chat)
        .bearer_auth("sesame")
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = s
        .client
        .post(&chat)
        .header("x-api-key", "sesame")
        .body(json!({"messages": user("x")}).to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "X-Api-Key, as llama-server takes it");
    for public in ["/health", "/v1/models", "/models", "/"] {
        let r = s
            .client
            .get(format!("{}{public}", s.base))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{public} is public, as in llama-server");
    }
}

#[tokio::test]
async fn request_fields_reach_the_job() {
    let s = serve(8, None, 1 << 20).await;
    let (status, _) = s
        .post_json(
            "/v1/chat/completions",
            &json!({"messages": user("x"), "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "seed": 42,
                    "stop": ["\n\n", "END"], "h2o_select": "hybrid", "h2o_sink": 2, "h2o_dense_tail": 32,
                    "frequency_penalty": 0.1, "user": "ignored"}),
        )
        .await;
    assert_eq!(status, 200);
    let job = s.fake.last.lock().unwrap().clone().unwrap();
    assert_eq!(job.sampling.max_tokens, 5);
    assert_eq!(job.sampling.temperature, 0.5);
    assert_eq!(job.sampling.top_p, 0.9);
    assert_eq!(job.sampling.seed, 42);
    assert_eq!(
        job.sampling.stop,
        vec!["\n\n".to_string(), "END".to_string()]
    );
    assert_eq!(job.h2o.select, Some(h2o_llama::Selection::Hybrid));
    assert_eq!(job.h2o.sink, Some(2));
    assert_eq!(job.h2o.dense_tail, Some(32));
}

#[tokio::test]
async fn tokenize_and_detokenize_answer_as_llama_server_does() {
    let s = serve(8, None, 1 << 20).await;
    let (status, body) = s.post_json("/tokenize", &json!({"content": "hé"})).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, json!({"tokens": [104, 195, 169]}));
    // pieces: whole UTF-8 as a string, a split character as its bytes
    let (_, body) = s
        .post_json("/tokenize", &json!({"content": "hé", "with_pieces": true}))
        .await;
    assert_eq!(
        body["tokens"],
        json!([{"id": 104, "piece": "h"}, {"id": 195, "piece": [195]}, {"id": 169, "piece": [169]}])
    );
    let (status, body) = s
        .post_json("/detokenize", &json!({"tokens": [104, 195, 169]}))
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, json!({"content": "hé"}));
}

#[tokio::test]
async fn tokenize_and_detokenize_refuse_bad_bodies_with_400s() {
    let s = serve(8, None, 1 << 20).await;
    let cases = [
        ("/tokenize", json!({}), "content"),
        ("/tokenize", json!({"content": 5}), "content"),
        ("/tokenize", json!({"content": "a\u{0}b"}), "content"),
        ("/detokenize", json!({"tokens": [1, 256]}), "tokens"),
        ("/detokenize", json!({"tokens": "abc"}), "tokens"),
        ("/detokenize", json!({"tokens": [-1]}), "tokens"),
    ];
    for (path, body, param) in cases {
        let (status, answer) = s.post_json(path, &body).await;
        assert_error(
            status,
            &answer,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        );
        assert_eq!(answer["error"]["param"], param, "{path} {body}: {answer}");
    }
}

#[tokio::test]
async fn infill_needs_the_fim_tokens_and_checks_its_fields_as_llama_server() {
    // a vocabulary without them: llama-server's 501 and message
    let s = serve(8, None, 1 << 20).await;
    let (status, body) = s
        .post_json(
            "/infill",
            &json!({"input_prefix": "a", "input_suffix": "b"}),
        )
        .await;
    assert_error(
        status,
        &body,
        StatusCode::NOT_IMPLEMENTED,
        "not_supported_error",
    );
    assert_eq!(
        body["error"]["message"],
        "Infill is not supported by this model: prefix token is missing. suffix token is \
         missing. middle token is missing. "
    );

    let mut fake = Fake::new(8);
    fake.info.fim = h2o_llama::FimTokens {
        prefix: Some(1),
        suffix: Some(2),
        middle: Some(3),
        ..Default::default()
    };
    let s = serve_fake(fake, Options::new(None, 1 << 20)).await;
    for (bad, message) in [
        (
            json!({"input_extra": "x"}),
            "\"input_extra\" must be an array of",
        ),
        (
            json!({"input_extra": [{"filename": "a.py"}]}),
            "extra_context chunk must contain a \"text\" field with a string value",
        ),
        (
            json!({"input_extra": [{"text": "t", "filename": 3}]}),
            "extra_context chunk's \"filename\" field must be a string",
        ),
        (json!({"prompt": 5}), "\"prompt\" must be a string"),
        (
            json!({"input_prefix": ["a"]}),
            "\"input_prefix\" must be a string",
        ),
        (json!({"input_suffix": "b", "n_predict": "x"}), "n_predict"),
    ] {
        let (status, body) = s.post_json("/infill", &bad).await;
        assert_error(
            status,
            &body,
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
        );
        let got = body["error"]["message"].as_str().unwrap();
        assert!(got.contains(message), "{bad}: {got}");
    }
    // a good one runs as /completion runs, with the code around the cursor as its prompt
    let (status, v) = s
        .post_json(
            "/infill",
            &json!({"input_prefix": "def f(", "input_suffix": "):", "prompt": "a",
                    "input_extra": [{"text": "x = 1"}, {"filename": "b.py", "text": "y"}],
                    "n_predict": 4, "temperature": 0}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(v["content"].is_string() && v["stop"] == true, "{v}");
    let job = s.fake.last.lock().unwrap().clone().unwrap();
    let chunk = |filename: &str, text: &str| crate::engine::InfillChunk {
        filename: filename.into(),
        text: text.into(),
    };
    let Prompt::Infill(infill) = &job.prompt else {
        panic!("not an infill prompt: {:?}", job.prompt);
    };
    assert_eq!(
        infill,
        &crate::engine::Infill {
            prefix: "def f(".into(),
            suffix: "):".into(),
            extra: vec![chunk("tmp", "x = 1"), chunk("b.py", "y")],
            prompt: "a".into(),
            n_predict: 4,
        }
    );
    assert_eq!(job.sampling.max_tokens, 4);
    // and streams as /completion streams
    let r = s
        .post(
            "/infill",
            json!({"input_prefix": "a", "stream": true}).to_string(),
        )
        .await;
    assert_eq!(r.status(), StatusCode::OK);
    let events = sse_data(&r.text().await.unwrap());
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["stop"], true, "{events:?}");
}
