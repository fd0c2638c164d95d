//! h2o-server end to end: the real binary on `--port 0` with the default model, spoken to over
//! HTTP as OpenAI clients and llama-server clients speak to it. Each test starts its own server
//! (SmolLM2-135M loads in well under a second), so that tests do not share slots or counters.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;

use reqwest::StatusCode;
use serde_json::{json, Value};

mod common;
use common::*;

#[test]
fn a_streamed_chat_reads_as_an_openai_client_reads_it() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(SHAPE);
    let request = json!({
        "model": "whatever", "messages": user(&format!("{}\nHow many ships were counted?", long_text(300))),
        "max_tokens": 24, "temperature": 0, "stream": true, "stream_options": {"include_usage": true},
    });
    let r = client()
        .post(server.url("/v1/chat/completions"))
        .json(&request)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let (events, _) = read_sse(r, usize::MAX);
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| {
            serde_json::from_str(e).unwrap_or_else(|err| panic!("chunk is not JSON ({err}): {e}"))
        })
        .collect();
    assert!(chunks.len() >= 3, "{chunks:?}");
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        assert_eq!(c["model"], "SmolLM2-135M-Instruct.Q4_1.gguf");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!content.is_empty());
    let (usage_chunk, rest) = chunks.split_last().unwrap();
    let finish = rest.last().unwrap();
    assert!(
        ["stop", "length"].contains(&finish["choices"][0]["finish_reason"].as_str().unwrap()),
        "{finish}"
    );
    assert_eq!(finish["choices"][0]["delta"], json!({}));
    assert!(finish["timings"]["prompt_n"].as_u64().unwrap() > 300);
    assert!(rest[..rest.len() - 1]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));
    let usage = &usage_chunk["usage"];
    assert_eq!(usage_chunk["choices"], json!([]));
    assert!(usage["completion_tokens"].as_u64().unwrap() <= 24);
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );

    // greedy: the same request without streaming says the same
    let mut plain = request.clone();
    plain["stream"] = json!(false);
    plain.as_object_mut().unwrap().remove("stream_options");
    let (status, body) = post(&server, "/v1/chat/completions", &plain);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["choices"][0]["message"]["content"], content);
    assert!(
        server
            .log_text()
            .contains("POST /v1/chat/completions 200 stream slot="),
        "{}",
        server.log_text()
    );
}

#[test]
fn chat_completions_and_completion_answer_in_their_shapes() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(SHAPE);
    let (status, chat) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is the capital of France?"}],
                "max_completion_tokens": 16, "temperature": 0}),
    );
    assert_eq!(status, 200, "{chat}");
    assert!(chat["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(chat["object"], "chat.completion");
    assert!(chat["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    assert!(
        !chat["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .is_empty(),
        "{chat}"
    );
    let u = &chat["usage"];
    assert!(
        u["prompt_tokens"].as_u64().unwrap() > 5 && u["completion_tokens"].as_u64().unwrap() <= 16
    );
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap())
    );

    let (status, cmpl) = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{cmpl}");
    assert_eq!(cmpl["object"], "text_completion");
    assert!(cmpl["id"].as_str().unwrap().starts_with("cmpl-"));
    assert!(cmpl["choices"][0]["text"].is_string());
    assert!(cmpl["usage"]["completion_tokens"].as_u64().unwrap() <= 8);

    // llama-server's /completion, with a prompt of several chunks: the H2O figures show
    let prompt = format!("{}\nThe harbour master", long_text(400));
    let (status, llama) = post(
        &server,
        "/completion",
        &json!({"prompt": prompt, "n_predict": 8, "temperature": 0, "stop": ["\n\n"]}),
    );
    assert_eq!(status, 200, "{llama}");
    assert!(llama["content"].is_string());
    assert_eq!(llama["stop"], true);
    assert!(
        ["eos", "limit", "word"].contains(&llama["stop_type"].as_str().unwrap()),
        "{llama}"
    );
    let evaluated = llama["tokens_evaluated"].as_u64().unwrap();
    assert!(evaluated > 380, "{llama}");
    // /tokenize counts a prompt as the engine does (with BOS, as completions add it), and
    // /detokenize gives the text back
    let (status, tokenized) = post(
        &server,
        "/tokenize",
        &json!({"content": prompt, "add_special": true}),
    );
    assert_eq!(status, 200, "{tokenized}");
    let tokens = tokenized["tokens"].as_array().unwrap();
    assert_eq!(tokens.len() as u64, evaluated);
    let (status, text) = post(
        &server,
        "/detokenize",
        &json!({"tokens": tokenized_without_bos(&server, &prompt)}),
    );
    assert_eq!(status, 200, "{text}");
    assert_eq!(text["content"], prompt.as_str());
    assert!(llama["tokens_predicted"].as_u64().unwrap() <= 8);
    let t = &llama["timings"];
    for field in [
        "prompt_n",
        "prompt_ms",
        "prompt_per_token_ms",
        "prompt_per_second",
        "predicted_n",
        "predicted_ms",
        "predicted_per_token_ms",
        "predicted_per_second",
        "cache_n",
        "ttft_ms",
        "h2o_chunks",
        "h2o_sparse_chunks",
        "h2o_dense_tail_tokens",
        "h2o_memory_size",
    ] {
        assert!(t[field].is_number(), "timings.{field}: {llama}");
    }
    assert_eq!(t["predicted_n"], llama["tokens_predicted"]);
    assert!(t["prompt_per_second"].as_f64().unwrap() > 0.0);
    assert_eq!(t["h2o_memory_size"], 32);
    assert_eq!(t["h2o_policy"], "coverage");
    assert!(t["h2o_sparse_chunks"].as_u64().unwrap() >= 1, "{t}");
    assert!(
        t["h2o_chunks"].as_u64().unwrap() > t["h2o_sparse_chunks"].as_u64().unwrap()
            || t["h2o_chunks"].as_u64().unwrap() >= 6,
        "{t}"
    );

    // a per-request policy is reported back
    let (status, seed_rule) = post(
        &server,
        "/completion",
        &json!({"prompt": prompt, "n_predict": 4, "h2o_select": "h2o", "h2o_sink": 0}),
    );
    assert_eq!(status, 200, "{seed_rule}");
    assert_eq!(seed_rule["timings"]["h2o_policy"], "seed");

    // a conversation's next turn finds its slot and evaluates only what is new: the chunks
    // before the first turn's dense tail are kept
    let mut messages = vec![
        json!({"role": "user", "content": format!("{}\nHow many ships were there?", long_text(300))}),
    ];
    let (status, first) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{first}");
    messages.push(first["choices"][0]["message"].clone());
    messages.push(json!({"role": "user", "content": "And at dusk?"}));
    let (status, second) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{second}");
    let t = &second["timings"];
    let cached = t["cache_n"].as_u64().unwrap();
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    // the boundary before turn 1's tail (its last 64 tokens) is at most a chunk (64) earlier
    assert!(
        cached >= first_prompt - 64 - 64,
        "turn 2 kept {cached} of turn 1's {first_prompt} prompt tokens: {second}"
    );

    // the llama-server stream: pieces with stop:false, then stop:true with the timings
    let r = client()
        .post(server.url("/completion"))
        .json(&json!({"prompt": "Once upon a time", "n_predict": 12, "stream": true}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let (events, _) = read_sse(r, usize::MAX);
    let events: Vec<Value> = events
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let (last, pieces) = events.split_last().unwrap();
    assert!(
        pieces
            .iter()
            .all(|e| e["stop"] == false && e["content"].is_string()),
        "{events:?}"
    );
    assert_eq!(last["stop"], true);
    assert!(last["timings"]["predicted_n"].as_u64().unwrap() <= 12);

    // /v1/completions streams text_completion chunks and [DONE]
    let r = client()
        .post(server.url("/v1/completions"))
        .json(&json!({"prompt": "Once upon a time", "max_tokens": 6, "stream": true}))
        .send()
        .unwrap();
    let (events, _) = read_sse(r, usize::MAX);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        assert_eq!(c["object"], "text_completion");
    }
}

#[test]
fn models_health_and_metrics_describe_the_server() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(SHAPE);
    let models = get_json(&server, "/v1/models");
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1.gguf");
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["meta"]["n_ctx_slot"], SLOT_CTX);
    let health = get_json(&server, "/health");
    assert_eq!(health["status"], "ok");
    assert_eq!(health["slots_idle"], 4);
    assert_eq!(health["slots_busy"], 0);

    let (status, _) = post(
        &server,
        "/v1/completions",
        &json!({"prompt": long_text(200), "max_tokens": 4}),
    );
    assert_eq!(status, 200);
    let text = metrics(&server);
    for (name, kind) in [
        ("requests_total", "counter"),
        ("requests_failed_total", "counter"),
        ("requests_cancelled_total", "counter"),
        ("requests_rejected_total", "counter"),
        ("prompt_tokens_total", "counter"),
        ("generated_tokens_total", "counter"),
        ("prefill_tokens_per_second", "gauge"),
        ("slots_busy", "gauge"),
        ("queue_length", "gauge"),
    ] {
        assert!(
            text.contains(&format!("# HELP h2o_server_{name} ")),
            "{name}:\n{text}"
        );
        assert!(
            text.contains(&format!("# TYPE h2o_server_{name} {kind}\n")),
            "{name}:\n{text}"
        );
    }
    assert!(sample(&text, "h2o_server_requests_total") >= 1.0);
    assert!(sample(&text, "h2o_server_prompt_tokens_total") >= 190.0);
    assert!(sample(&text, "h2o_server_prefill_tokens_per_second") > 0.0);
    assert_eq!(sample(&text, "h2o_server_slots_busy"), 0.0);
}

#[test]
fn four_concurrent_greedy_requests_say_what_they_say_one_by_one() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(SHAPE);
    let requests: Vec<Value> = [
        ("Name three colours.", 0),
        ("The harbour master's count", 150),
        ("Summarise the ledger in one line.", 350),
        ("What did the harbour master write down?", 600),
    ]
    .into_iter()
    .map(|(question, n)| {
        json!({"messages": user(&format!("{}{question}", long_text(n))), "max_tokens": 24, "temperature": 0})
    })
    .collect();
    let answer = |body: &Value| -> String {
        let (status, v) = post(&server, "/v1/chat/completions", body);
        assert_eq!(status, 200, "{v}");
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let one_by_one: Vec<String> = requests.iter().map(answer).collect();
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = requests
            .iter()
            .map(|r| s.spawn(move || answer(r)))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(one_by_one, together);
}

/// path, body, status, error type, error param
type BadCase<'a> = (&'a str, Vec<u8>, u16, &'a str, Option<&'a str>);

#[test]
fn bad_input_gets_openai_errors_and_the_server_carries_on() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(&[SHAPE, &["--max-body", "65536"]].concat());
    let chat = "/v1/chat/completions";
    let ok_messages = user("Hi");
    let too_long = long_text(3 * SLOT_CTX);
    let bytes = |v: Value| v.to_string().into_bytes();
    let cases: Vec<BadCase> = vec![
        (
            chat,
            b"{\"messages\": [".to_vec(),
            400,
            "invalid_request_error",
            None,
        ),
        (
            chat,
            b"not json".to_vec(),
            400,
            "invalid_request_error",
            None,
        ),
        (chat, Vec::new(), 400, "invalid_request_error", None),
        (chat, b"[1, 2]".to_vec(), 400, "invalid_request_error", None),
        (
            chat,
            vec![b'{', b'"', b'm', 0xc3, 0x28, b'"', b':', b'1', b'}'],
            400,
            "invalid_request_error",
            None,
        ),
        (
            chat,
            bytes(json!({})),
            400,
            "invalid_request_error",
            Some("messages"),
        ),
        (
            chat,
            bytes(json!({"messages": "Hi"})),
            400,
            "invalid_request_error",
            Some("messages"),
        ),
        (
            chat,
            bytes(json!({"messages": []})),
            400,
            "invalid_request_error",
            Some("messages"),
        ),
        (
            chat,
            bytes(json!({"messages": [{"role": "user"}], "max_tokens": 4})),
            200,
            "",
            None,
        ),
        (
            chat,
            bytes(json!({"messages": [{"role": "wizard", "content": "x"}]})),
            400,
            "invalid_request_error",
            Some("messages[0].role"),
        ),
        (
            chat,
            bytes(json!({"messages": [{"role": "user", "content": {"text": "x"}}]})),
            400,
            "invalid_request_error",
            Some("messages[0].content"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "max_tokens": "ten"})),
            400,
            "invalid_request_error",
            Some("max_tokens"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "max_tokens": 0})),
            400,
            "invalid_request_error",
            Some("max_tokens"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "max_tokens": SLOT_CTX + 1})),
            400,
            "invalid_request_error",
            Some("max_tokens"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "max_tokens": 1_000_000_000_000_i64})),
            400,
            "invalid_request_error",
            Some("max_tokens"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "temperature": -1})),
            400,
            "invalid_request_error",
            Some("temperature"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "temperature": 100})),
            400,
            "invalid_request_error",
            Some("temperature"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "top_p": 2})),
            400,
            "invalid_request_error",
            Some("top_p"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "top_p": "high"})),
            400,
            "invalid_request_error",
            Some("top_p"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "seed": "x"})),
            400,
            "invalid_request_error",
            Some("seed"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "stop": 5})),
            400,
            "invalid_request_error",
            Some("stop"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "stream": 1})),
            400,
            "invalid_request_error",
            Some("stream"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "n": 3, "stream": true})),
            400,
            "invalid_request_error",
            Some("n"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "h2o_select": "query-aware"})),
            400,
            "invalid_request_error",
            Some("h2o_select"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "h2o_sink": 17})),
            400,
            "invalid_request_error",
            Some("h2o_sink"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "h2o_dense_tail": -1})),
            400,
            "invalid_request_error",
            Some("h2o_dense_tail"),
        ),
        (
            chat,
            bytes(json!({"messages": user("a\u{0}b")})),
            400,
            "invalid_request_error",
            Some("messages[0].content"),
        ),
        (
            chat,
            bytes(json!({"messages": user(&too_long)})),
            400,
            "exceed_context_size_error",
            Some("messages"),
        ),
        (
            chat,
            bytes(json!({"messages": user(&too_long), "stream": true})),
            400,
            "exceed_context_size_error",
            Some("messages"),
        ),
        (
            chat,
            bytes(json!({"messages": user(&"x".repeat(70_000))})),
            413,
            "invalid_request_error",
            None,
        ),
        (
            "/v1/completions",
            bytes(json!({"prompt": ""})),
            400,
            "invalid_request_error",
            Some("prompt"),
        ),
        (
            "/v1/completions",
            bytes(json!({"prompt": 42})),
            400,
            "invalid_request_error",
            Some("prompt"),
        ),
        (
            "/v1/completions",
            bytes(json!({"max_tokens": 4})),
            400,
            "invalid_request_error",
            Some("prompt"),
        ),
        (
            "/v1/completions",
            bytes(json!({"prompt": too_long})),
            400,
            "exceed_context_size_error",
            Some("prompt"),
        ),
        (
            "/completion",
            bytes(json!({"prompt": "x", "n_predict": -5})),
            400,
            "invalid_request_error",
            Some("n_predict"),
        ),
        (
            "/completion",
            bytes(json!({"prompt": "x", "n_predict": 4096})),
            400,
            "invalid_request_error",
            Some("n_predict"),
        ),
        (
            "/v1/embeddings",
            bytes(json!({"input": "x"})),
            404,
            "not_found_error",
            None,
        ),
        // llama-server's bad sampling input: 400 naming the field, the slot never taken
        (
            chat,
            bytes(json!({"messages": ok_messages, "logit_bias": {"4000000": -100}})),
            400,
            "invalid_request_error",
            Some("logit_bias"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "logit_bias": [[1, "x"]]})),
            400,
            "invalid_request_error",
            Some("logit_bias"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "grammar": "root ::= ("})),
            400,
            "invalid_request_error",
            Some("grammar"),
        ),
        (
            "/completion",
            bytes(json!({"prompt": "x", "grammar": "root ::= undefined-rule"})),
            400,
            "invalid_request_error",
            Some("grammar"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "json_schema": {"type": "hiccup"}})),
            400,
            "invalid_request_error",
            Some("json_schema"),
        ),
        (
            chat,
            bytes(
                json!({"messages": ok_messages, "response_format": {"type": "json_object", "schema": 123}}),
            ),
            400,
            "invalid_request_error",
            Some("response_format"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "response_format": {"type": "sound"}})),
            400,
            "invalid_request_error",
            Some("response_format"),
        ),
        (
            chat,
            bytes(
                json!({"messages": ok_messages, "tools": [{"type": "function", "function": {"name": "f"}}]}),
            ),
            400,
            "invalid_request_error",
            Some("tools"),
        ),
        (
            chat,
            bytes(
                json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}]}),
            ),
            400,
            "invalid_request_error",
            Some("messages"),
        ),
        (
            "/completion",
            bytes(json!({"prompt": [1, 2, 99_999_999]})),
            400,
            "invalid_request_error",
            Some("prompt"),
        ),
        (
            chat,
            bytes(json!({"messages": ok_messages, "logprobs": true, "top_logprobs": 21})),
            400,
            "invalid_request_error",
            Some("top_logprobs"),
        ),
    ];
    for (path, body, status, kind, param) in cases {
        let shown = String::from_utf8_lossy(&body)
            .chars()
            .take(120)
            .collect::<String>();
        let r = client()
            .post(server.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .unwrap();
        let got = r.status();
        let text = r.text().unwrap();
        assert_eq!(got.as_u16(), status, "{path} {shown}: {text}");
        if status == 200 {
            continue;
        }
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|_| panic!("{path} {shown}: not a JSON error: {text}"));
        let e = &v["error"];
        assert_eq!(e["type"], kind, "{path} {shown}: {text}");
        assert!(
            e["message"].as_str().is_some_and(|m| m.len() > 10),
            "{text}"
        );
        assert_eq!(
            e["code"], status,
            "llama-server's code is the status: {text}"
        );
        if let Some(p) = param {
            assert_eq!(e["param"], p, "{path} {shown}: {text}");
        }
    }
    let (_, v) = post(&server, chat, &json!({"messages": user(&too_long)}));
    assert!(
        v["error"]["n_prompt_tokens"].as_u64() > Some(SLOT_CTX as u64),
        "llama-server's exceed_context_size_error fields: {v}"
    );
    assert_eq!(v["error"]["n_ctx"], SLOT_CTX, "{v}");
    let r = client().get(server.url(chat)).send().unwrap();
    assert_eq!(r.status(), 405);
    assert!(r.json::<Value>().unwrap()["error"]["message"].is_string());

    // none of that disturbed the server
    let (status, v) = post(
        &server,
        chat,
        &json!({"messages": ok_messages, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(!v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
    let health = get_json(&server, "/health");
    assert_eq!(health["slots_busy"], 0);
}

#[test]
fn an_api_key_is_required_except_for_health_and_models_and_sigterm_exits_0() {
    let _engine = common::one_engine_at_a_time();
    let mut server = Server::start(&[SHAPE, &["--api-key", "s3cret"]].concat());
    let body = json!({"messages": user("Hi"), "max_tokens": 4});
    for auth in [
        None,
        Some("Bearer nope"),
        Some("s3cret"),
        Some("Basic s3cret"),
    ] {
        let mut req = client()
            .post(server.url("/v1/chat/completions"))
            .json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let r = req.send().unwrap();
        assert_eq!(r.status(), 401, "{auth:?}");
        let v: Value = r.json().unwrap();
        assert_eq!(v["error"]["type"], "authentication_error");
    }
    assert_eq!(
        client()
            .get(server.url("/v1/models"))
            .send()
            .unwrap()
            .status(),
        200,
        "the model list is public, as in llama-server"
    );
    assert_eq!(
        client()
            .get(server.url("/metrics"))
            .send()
            .unwrap()
            .status(),
        401
    );
    assert_eq!(
        client().get(server.url("/health")).send().unwrap().status(),
        200
    );
    let r = client()
        .post(server.url("/v1/chat/completions"))
        .bearer_auth("s3cret")
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = client()
        .post(server.url("/v1/chat/completions"))
        .header("x-api-key", "s3cret")
        .json(&body)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200, "llama-server's X-Api-Key header");

    let status = server.terminate(PATIENCE);
    assert_eq!(status.code(), Some(0), "{}", server.log_text());
}

#[test]
fn sigterm_during_a_stream_ends_it_and_exits_0() {
    let _engine = common::one_engine_at_a_time();
    let mut server = Server::start(SHAPE);
    let r = client()
        .post(server.url("/v1/chat/completions"))
        .json(&json!({"messages": user("Tell me a long story about a lighthouse keeper."), "max_tokens": 900, "stream": true}))
        .send()
        .unwrap();
    let (events, mut rest) = read_sse(r, 2);
    assert_eq!(events.len(), 2);
    let status = server.terminate(PATIENCE);
    assert_eq!(status.code(), Some(0), "{}", server.log_text());
    // the stream ends (with an error event, or cut short) rather than hanging
    let mut tail = String::new();
    let _ = rest.read_to_string(&mut tail);
    assert!(
        server.log_text().contains("h2o-server: stopped"),
        "{}",
        server.log_text()
    );
}

#[test]
fn a_client_leaving_mid_stream_frees_its_slot() {
    let _engine = common::one_engine_at_a_time();
    // one slot: the next request completes only if the abandoned one let go of it
    let server = Server::start(&[
        "-c",
        "2048",
        "-np",
        "1",
        "-ub",
        "64",
        "-b",
        "256",
        "--h2o-local",
        "16",
        "--h2o-heavy",
        "16",
    ]);
    let r = client()
        .post(server.url("/v1/chat/completions"))
        .json(&json!({"messages": user("Write a long story about a lighthouse keeper and his cat."), "max_tokens": 1500,
                      "temperature": 0.8, "seed": 7, "stream": true}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let (events, reader) = read_sse(r, 2);
    let chunk: Value = serde_json::from_str(&events[1]).unwrap();
    assert!(
        chunk["choices"][0]["delta"]["content"].is_string(),
        "{chunk}"
    );
    drop(reader);

    wait_until("the slot is free again", PATIENCE, || {
        get_json(&server, "/health")["slots_busy"] == 0
    });
    wait_until("the job counts as cancelled", PATIENCE, || {
        sample(&metrics(&server), "h2o_server_requests_cancelled_total") >= 1.0
    });
    assert!(
        server.log_text().contains("(client disconnected)"),
        "{}",
        server.log_text()
    );
    let (status, v) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": user("Hi"), "max_tokens": 4}),
    );
    assert_eq!(status, 200, "{v}");
}

#[test]
fn a_client_leaving_during_a_long_prompt_call_stops_it_inside_llama_decode() {
    let _engine = common::one_engine_at_a_time();
    // one slot, and the whole prompt in one call (-b = -c): only an abort inside llama_decode
    // frees the slot before that call ends
    let server = Server::start(&[
        "-c",
        "4096",
        "-np",
        "1",
        "-ub",
        "512",
        "-b",
        "4096",
        "--h2o-local",
        "128",
        "--h2o-heavy",
        "128",
    ]);
    let body = json!({"prompt": long_text(3600), "max_tokens": 4}).to_string();
    let addr = server.base.trim_start_matches("http://").to_string();
    // a raw connection, so that it can be closed the moment the prompt call is seen to start
    let mut conn = TcpStream::connect(&addr).unwrap();
    write!(
        conn,
        "POST /v1/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    wait_until("the prompt call starts", PATIENCE, || {
        get_json(&server, "/health")["slots_busy"] == 1
    });
    drop(conn);
    wait_until("the slot is free again", PATIENCE, || {
        get_json(&server, "/health")["slots_busy"] == 0
    });
    let m = metrics(&server);
    assert_eq!(
        sample(&m, "h2o_server_prompt_tokens_total"),
        0.0,
        "the prompt call ran to its end instead of stopping:\n{m}"
    );
    assert_eq!(
        sample(&m, "h2o_server_requests_cancelled_total"),
        1.0,
        "{m}"
    );
    let (status, v) = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "The harbour master", "max_tokens": 4}),
    );
    assert_eq!(status, 200, "{v}");
}

#[test]
fn a_full_queue_answers_503_with_retry_after() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(&[
        "-c",
        "2048",
        "-np",
        "1",
        "--queue",
        "1",
        "-ub",
        "64",
        "-b",
        "256",
        "--h2o-local",
        "16",
        "--h2o-heavy",
        "16",
    ]);
    // One runs, one waits, the rest find the queue full. Each step waits for the server to show
    // the state the next one needs (/health), so the outcome does not depend on how fast the
    // machine prefills. The running request streams up to 900 greedy tokens of a repeated
    // sentence: it holds the slot until the test lets go of it.
    let health_is = |busy: u64, queued: u64| {
        let h = get_json(&server, "/health");
        h["slots_busy"] == busy && h["queue_length"] == queued
    };
    let body = |max_tokens: u32, stream: bool| json!({"prompt": long_text(1000), "max_tokens": max_tokens, "temperature": 0, "stream": stream});
    let send = |body: &Value| {
        let r = client()
            .post(server.url("/v1/completions"))
            .json(body)
            .send()
            .unwrap();
        let retry = r
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap().to_string());
        (r.status(), retry, r)
    };
    std::thread::scope(|s| {
        let running = s.spawn(|| send(&body(900, true)));
        wait_until(
            "the first request runs in the slot, with nobody queued",
            PATIENCE,
            || health_is(1, 0),
        );
        let waiting = s.spawn(|| {
            let (status, retry, r) = send(&body(32, false));
            (status, retry, r.json::<Value>().unwrap())
        });
        wait_until("the second request waits in the queue", PATIENCE, || {
            health_is(1, 1)
        });
        let mut results: Vec<(StatusCode, Option<String>, Value)> = (0..4)
            .map(|_| {
                let (status, retry, r) = send(&body(32, false));
                (status, retry, r.json::<Value>().unwrap())
            })
            .collect();
        assert!(
            health_is(1, 1),
            "the first request ended before the queue-full answers were checked: {results:?}"
        );
        // the first request's client leaves: its slot goes to the waiting request
        let (status, retry, stream) = running.join().unwrap();
        assert_eq!(status, StatusCode::OK);
        drop(stream);
        results.push((status, retry, json!({"streamed": true})));
        results.push(waiting.join().unwrap());

        let busy: Vec<_> = results
            .iter()
            .filter(|(s, _, _)| *s == StatusCode::SERVICE_UNAVAILABLE)
            .collect();
        assert!(
            !busy.is_empty(),
            "no request found the queue full: {results:?}"
        );
        assert!(
            results
                .iter()
                .filter(|(s, _, _)| *s == StatusCode::OK)
                .count()
                >= 2,
            "{results:?}"
        );
        assert_eq!(busy.len(), 4, "{results:?}");
        for (status, retry, v) in &results {
            if *status == StatusCode::OK {
                continue;
            }
            assert_eq!(*status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
            let seconds: u64 = retry.as_deref().expect("Retry-After").parse().unwrap();
            assert!(seconds >= 1);
            assert_eq!(v["error"]["type"], "unavailable_error", "{v}");
        }
        assert_eq!(
            sample(&metrics(&server), "h2o_server_requests_rejected_total") as usize,
            busy.len()
        );
    });
    let (status, _) = post(
        &server,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 2}),
    );
    assert_eq!(status, 200);
}

/// Flag errors need no model: they are caught before the download and the model load.
#[test]
fn bad_flags_exit_with_a_message_naming_the_flag() {
    let _engine = common::one_engine_at_a_time();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (
            vec!["-ub", "64", "--h2o-local", "32", "--h2o-heavy", "32"],
            3,
            "must be smaller than the chunk size -ub 64",
        ),
        (
            vec![
                "-c",
                "256",
                "-np",
                "4",
                "-ub",
                "128",
                "--h2o-local",
                "32",
                "--h2o-heavy",
                "32",
            ],
            3,
            "each of the -np 4 slots has -c 256 / 4 = 64 tokens",
        ),
        (
            vec!["--h2o-local", "16", "--h2o-heavy", "16", "--h2o-sink", "17"],
            3,
            "--h2o-sink 17 is larger than the heavy budget",
        ),
        (
            vec!["--h2o-local", "-3"],
            3,
            "--h2o-local must be between 0",
        ),
        (vec!["-np", "0"], 3, "-np must be at least 1"),
        (vec!["-ub", "512", "-b", "256"], 3, "use -ub <= -b"),
        (vec!["--max-body", "0"], 3, "--max-body must be at least 1"),
        (vec!["--port", &port], 3, "cannot listen on 127.0.0.1:"),
        (
            vec!["--h2o-select", "nope"],
            2,
            "unknown H2O selection policy \"nope\": use one of seed, hybrid, coverage",
        ),
        (vec!["--port", "70000"], 2, "70000"),
        (vec!["--no-such-flag"], 2, "--no-such-flag"),
    ];
    for (args, code, message) in cases {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_h2o-server"));
        if !args.contains(&"--port") {
            // were a case to pass its checks, it would not take port 8080 from anyone
            cmd.args(["--port", "0"]);
        }
        let out = cmd
            .args(&args)
            .env_remove("H2O_SERVER_API_KEY")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {stderr}");
        assert!(stderr.contains(message), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
    drop(taken);
}

/// llama.cpp's server tests start llama-server with a small `-b`; such command lines, and
/// llama.cpp's default `-ub`, start and serve: H2O turned on by itself leaves chunks that do not
/// hold its memory to full attention, and `/props` and the setup line say so.
#[test]
fn everyday_llama_server_command_lines_start_and_serve() {
    let _engine = common::one_engine_at_a_time();
    for (args, outcome, memory) in [
        (
            &[
                "--batch-size",
                "32",
                "--ctx-size",
                "4096",
                "--parallel",
                "1",
            ][..],
            "full_attention",
            None,
        ),
        (&["-ub", "512"], "full_attention", None),
        (&[], "on", Some(256)),
    ] {
        let server = Server::start(args);
        let props = get_json(&server, "/props");
        assert_eq!(props["h2o_auto"]["outcome"], outcome, "{args:?}: {props}");
        match memory {
            Some(m) => assert_eq!(props["h2o"]["local"], m, "{props}"),
            None => assert!(props["h2o"].is_null(), "{props}"),
        }
        let (status, v) = post(
            &server,
            "/completion",
            &json!({"prompt": "I believe the meaning of life is", "n_predict": 8}),
        );
        assert_eq!(status, 200, "{args:?}: {v}");
        assert_eq!(v["tokens_predicted"], 8, "{v}");
        let log = server.log_text();
        assert!(
            log.contains(props["h2o_auto"]["note"].as_str().unwrap()),
            "{log}"
        );
    }
}

/// As llama-server: a request's seed (or the server's `--seed`) seeds its own sampler, so that
/// identical requests give identical text whatever the slot they run on, first or later, alone
/// or beside another, streamed or not.
#[test]
fn identical_seeded_requests_give_identical_text_on_every_slot() {
    let _engine = common::one_engine_at_a_time();
    // full attention, and H2O with sparse decode
    for h2o in ["off", "on"] {
        seeded_requests_agree(&[
            "--seed",
            "42",
            "--temp",
            "0.8",
            "--parallel",
            "2",
            "-c",
            "4096",
            "--h2o",
            h2o,
        ]);
    }
}

fn seeded_requests_agree(args: &[&str]) {
    let server = Server::start(args);
    let body = json!({"prompt": "I believe the meaning of life is", "n_predict": 24});
    let text = |v: &Value| v["content"].as_str().unwrap().to_string();
    let (status, first) = post(&server, "/completion", &body);
    assert_eq!(status, 200, "{first}");
    let first_text = text(&first);
    for _ in 0..2 {
        assert_eq!(text(&post(&server, "/completion", &body).1), first_text);
    }
    // without the cached prompt, as llama.cpp's own test of this asks
    let mut uncached = body.clone();
    uncached["cache_prompt"] = json!(false);
    assert_eq!(text(&post(&server, "/completion", &uncached).1), first_text);
    // streamed
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = client()
        .post(server.url("/completion"))
        .json(&streamed)
        .send()
        .unwrap();
    let (events, _) = read_sse(r, usize::MAX);
    let pieces: String = events
        .iter()
        .map(|e| {
            serde_json::from_str::<Value>(e).unwrap()["content"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(pieces, first_text);
    // two at once, so that both slots run side by side in the same decode steps
    let both: Vec<(String, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                s.spawn(|| {
                    let v = post(&server, "/completion", &body).1;
                    (text(&v), v["id_slot"].clone())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let slots: Vec<&Value> = both.iter().map(|(_, slot)| slot).collect();
    assert_ne!(
        slots[0], slots[1],
        "both requests ran on one slot: {both:?}"
    );
    for (t, slot) in &both {
        assert_eq!(t, &first_text, "slot {slot}");
    }
    // pinned to each slot (llama-server's id_slot): it runs there, with the same text
    for slot in 0..2 {
        let mut pinned = body.clone();
        pinned["id_slot"] = json!(slot);
        let (status, v) = post(&server, "/completion", &pinned);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["id_slot"], json!(slot), "{v}");
        assert_eq!(text(&v), first_text, "slot {slot}");
    }
    let mut nowhere = body.clone();
    nowhere["id_slot"] = json!(2);
    let (status, v) = post(&server, "/completion", &nowhere);
    assert_eq!(status, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("id_slot 2") && msg.contains("0 to 1"), "{msg}");
    // another seed in the request gives other text (the seed is the request's)
    let mut other = body.clone();
    other["seed"] = json!(7);
    assert_ne!(text(&post(&server, "/completion", &other).1), first_text);
}

/// `/infill` lays out its prompt by llama-server's rules with the fill-in-the-middle tokens the
/// model's GGUF declares (a tiny random-weight model with the default model's tokenizer and
/// five of its special tokens declared as FIM tokens); the default model, which declares none,
/// gets llama-server's error.
#[test]
fn infill_lays_out_the_prompt_with_the_models_fim_tokens() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(&["-c", "2048"]);
    let (status, v) = post(
        &server,
        "/infill",
        &json!({"input_prefix": "a", "input_suffix": "b"}),
    );
    assert_eq!(status, 501, "{v}");
    assert_eq!(
        v["error"]["message"],
        "Infill is not supported by this model: prefix token is missing. suffix token is \
         missing. middle token is missing. "
    );
    drop(server);

    let dir = common::scratch("server-infill");
    let mut tiny = common::tiny_models::llama_gqa();
    // <repo_name>, <file_sep>, <issue_start>, <issue_comment>, <issue_closed>
    let (rep, sep, pre, suf, mid) = (3, 5, 8, 9, 10);
    for (key, id) in [
        ("rep", rep),
        ("sep", sep),
        ("pre", pre),
        ("suf", suf),
        ("mid", mid),
    ] {
        tiny.gguf
            .set(&format!("tokenizer.ggml.fim_{key}_token_id"), id as u32);
    }
    let path = dir.join("fim.gguf");
    tiny.gguf.write(&path).unwrap();
    let server = Server::start_model(
        path.to_str().unwrap(),
        &["-c", "2048", "-np", "1", "-b", "512"],
        None,
    );
    let (prefix, suffix, prompt) = ("def add(a, b):\n", "\nprint(add(1, 2))\n", "    return");
    let (status, v) = post(
        &server,
        "/infill",
        &json!({"input_prefix": prefix, "input_suffix": suffix, "prompt": prompt,
                "input_extra": [{"filename": "util.py", "text": "import os\n"}],
                "n_predict": 4, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["tokens_predicted"], 4, "{v}");
    // llama-server's layout: the repository and its files, then prefix, prompt, suffix
    let tokens = |text: &str| -> Vec<i64> {
        let t = tokenized_without_bos(&server, text);
        t.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_i64().unwrap())
            .collect()
    };
    let want: Vec<i64> = [
        vec![rep],
        tokens("myproject\n"),
        vec![sep],
        tokens("util.py\n"),
        tokens("import os\n"),
        vec![sep],
        tokens("filename\n"),
        vec![pre],
        tokens(prefix),
        tokens(prompt),
        vec![suf],
        tokens(suffix),
        vec![mid],
    ]
    .concat();
    assert_eq!(v["tokens_evaluated"], want.len(), "{v}");
    let (status, text) = post(&server, "/detokenize", &json!({ "tokens": want }));
    assert_eq!(status, 200, "{text}");
    assert_eq!(v["prompt"], text["content"], "{v}");
    assert!(
        v["prompt"]
            .as_str()
            .unwrap()
            .starts_with("<repo_name>myproject\n<file_sep>util.py"),
        "{v}"
    );
}
