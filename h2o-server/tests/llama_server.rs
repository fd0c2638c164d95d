//! h2o-server as a drop-in for llama-server, end to end on the real model: what llama-server's
//! clients send beyond OpenAI's basics (`logit_bias`, grammars, `response_format`, log-probs,
//! token prompts, `/slots`, `/apply-template`, `return_progress`, CORS) does what it does there.

use std::time::Duration;

use h2o_llama::{
    FlashAttention, H2oConfig, Model, ModelParams, ParallelSession, SessionConfig, TokenLogprobs,
};
use serde_json::{json, Value};

mod common;
use common::*;

/// The first greedy token of a chat, and its id.
fn first_token(server: &Server, body: &Value) -> (String, i64) {
    let mut body = body.clone();
    body["n_probs"] = 1.into();
    body["n_predict"] = 1.into();
    body["temperature"] = 0.into();
    let (status, v) = post(server, "/completion", &body);
    assert_eq!(status, 200, "{v}");
    let p = &v["completion_probabilities"][0];
    (
        p["token"].as_str().unwrap().to_string(),
        p["id"].as_i64().unwrap(),
    )
}

/// h2o-server with these flags (and the default model) stops at start with exit 3, naming
/// `flag` on stderr.
fn refused_at_start(args: &[&str], flag: &str) {
    use std::io::Read;
    use std::time::{Duration, Instant};
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_h2o-server"))
        .args(["-m", &model_path(), "--port", "0"])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // read as it comes, so that a long log cannot fill the pipe and stop the server
    let mut stderr = child.stderr.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut err = Vec::new();
        stderr.read_to_end(&mut err).unwrap();
        String::from_utf8_lossy(&err).into_owned()
    });
    // a server that starts instead of refusing would serve until killed: fail instead of hanging
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            child.kill().unwrap();
            child.wait().unwrap();
            panic!("{args:?}: the server was still running after 120 s instead of refusing");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let err = reader.join().unwrap();
    assert_eq!(status.code(), Some(3), "{args:?}: {err}");
    assert!(err.contains(flag), "{args:?}: {err}");
}

#[test]
fn logit_bias_grammar_and_json_output_change_what_is_sampled() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(SHAPE);
    let prompt = json!({"prompt": "The capital of France is"});
    let (text, banned) = first_token(&server, &prompt);
    // OpenAI's object form and llama-server's pair form, by id and by text, each banning the
    // greedy first token
    for bias in [
        json!({ banned.to_string(): -100 }),
        json!([[banned, false]]),
        json!({ text.clone(): -100 }),
        json!([[text, false]]),
    ] {
        let mut body = prompt.clone();
        body["logit_bias"] = bias.clone();
        let (_, id) = first_token(&server, &body);
        assert_ne!(
            id, banned,
            "logit_bias {bias} left the greedy token {banned}"
        );
    }

    let (status, v) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": user("Say anything."), "grammar": "root ::= \"a\"{5,5}", "max_tokens": 8}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "aaaaa", "{v}");

    // a JSON schema, through llama.cpp's converter: the answer parses and follows it
    let schema = json!({"type": "object", "required": ["name", "age"],
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}});
    for body in [
        json!({"json_schema": schema}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}),
    ] {
        let mut body = body;
        body["messages"] = user("Name a person, as JSON.");
        body["temperature"] = 0.into();
        body["max_tokens"] = 64.into();
        let (status, v) = post(&server, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        let text = v["choices"][0]["message"]["content"].as_str().unwrap();
        let person: Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("schema output does not parse ({e}): {text:?}"));
        assert!(
            person["name"].is_string() && person["age"].is_i64(),
            "{person}"
        );
        assert_eq!(person.as_object().unwrap().len(), 2, "{person}");
    }

    let (status, v) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": user("Describe a cat as JSON."), "temperature": 0,
                "response_format": {"type": "json_object"}, "max_tokens": 96}),
    );
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        let parsed: Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("json_object output does not parse ({e}): {text:?}"));
        assert!(parsed.is_object(), "{text}");
    } else {
        // cut by max_tokens: still a JSON object's beginning
        assert!(text.trim_start().starts_with('{'), "{text:?}");
    }
}

#[test]
fn logprobs_agree_with_the_models_logits() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(SHAPE);
    let prompt = "Once upon a time";
    let (status, v) = post(
        &server,
        "/completion",
        &json!({"prompt": prompt, "n_predict": 3, "n_probs": 5, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let probs = v["completion_probabilities"].as_array().unwrap();
    assert_eq!(probs.len(), 3, "{v}");
    // the same prompt through the library, in a context shaped as the server's (4 slots of
    // 1024, -ub 64, H2O 16 + 16, flash attention off as auto makes it with several slots)
    let model = Model::load(model_path(), &ModelParams::default()).unwrap();
    let config = SessionConfig {
        n_ctx: 1024,
        n_batch: 256,
        n_ubatch: 64,
        flash_attn: FlashAttention::Off,
        h2o: Some(H2oConfig::new(16, 16)),
        h2o_undo_log: true,
        ..SessionConfig::default()
    };
    let mut session = ParallelSession::new(&model, config, 4).unwrap();
    let tokens = model.tokenize(prompt, true, true).unwrap();
    session.start_prompt(0, &tokens, None).unwrap();
    session.prefill(0, &tokens, usize::MAX).unwrap();
    let first = probs[0]["id"].as_i64().unwrap() as i32;
    let want = TokenLogprobs::from_logits(session.logits(None).unwrap(), first, 5);
    let got = probs[0]["logprob"].as_f64().unwrap();
    assert!(
        (got - f64::from(want.logprob)).abs() < 1e-3,
        "server {got} vs the model's logits {}",
        want.logprob
    );
    for (i, p) in probs.iter().enumerate() {
        let top = p["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 5);
        // greedy: the token is the likeliest, with the same log-probability
        assert_eq!(top[0]["id"], p["id"], "token {i}: {p}");
        assert_eq!(top[0]["logprob"], p["logprob"]);
        let lp: Vec<f64> = top.iter().map(|t| t["logprob"].as_f64().unwrap()).collect();
        assert!(
            lp.windows(2).all(|w| w[0] >= w[1]) && lp[0] <= 0.0,
            "{lp:?}"
        );
        assert!(lp.iter().map(|l| l.exp()).sum::<f64>() <= 1.0 + 1e-6);
    }
    for (i, (w, g)) in want
        .top
        .iter()
        .zip(probs[0]["top_logprobs"].as_array().unwrap())
        .enumerate()
    {
        assert_eq!(i64::from(w.0), g["id"].as_i64().unwrap(), "rank {i}");
    }

    // OpenAI's chat logprobs: the pieces spell the answer
    let (status, v) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": user("Hi"), "max_tokens": 6, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
    );
    assert_eq!(status, 200, "{v}");
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let spelled: String = content
        .iter()
        .map(|t| t["token"].as_str().unwrap())
        .collect();
    assert_eq!(
        spelled,
        v["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert!(content
        .iter()
        .all(|t| t["top_logprobs"].as_array().unwrap().len() == 2));
}

#[test]
fn completion_takes_token_prompts_and_reports_llama_servers_fields() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(SHAPE);
    let text = "I believe the meaning of life is";
    let (_, t) = post(
        &server,
        "/tokenize",
        &json!({"content": text, "add_special": true}),
    );
    let tokens = t["tokens"].clone();
    let greedy = |prompt: Value| {
        let (status, v) = post(
            &server,
            "/completion",
            &json!({"prompt": prompt, "n_predict": 6, "temperature": 0, "return_tokens": true}),
        );
        assert_eq!(status, 200, "{v}");
        v
    };
    let by_text = greedy(json!(text));
    let by_tokens = greedy(tokens.clone());
    assert_eq!(by_text["content"], by_tokens["content"]);
    assert_eq!(
        by_tokens["tokens"].as_array().unwrap().len(),
        6,
        "{by_tokens}"
    );
    assert_eq!(by_text["generation_settings"]["n_predict"], 6);
    assert_eq!(by_text["truncated"], false);
    assert!(by_text["has_new_line"].is_boolean());
    assert_eq!(by_text["stop_type"], "limit");
    let both = greedy(json!([tokens, text]));
    let both = both.as_array().expect("two prompts: an array of answers");
    assert_eq!(both.len(), 2);
    assert_eq!(both[0]["content"], both[1]["content"]);
    assert_eq!(both[0]["content"], by_text["content"]);

    // response_fields: only those, keyed by their paths
    let (_, v) = post(
        &server,
        "/completion",
        &json!({"prompt": text, "n_predict": 2, "response_fields": ["content", "generation_settings/n_predict"]}),
    );
    assert_eq!(v.as_object().unwrap().len(), 2, "{v}");
    assert_eq!(v["generation_settings/n_predict"], 2);

    // a stream: every piece has its tokens; progress events count the prompt's chunks
    let long = format!("{}{text}", long_text(300));
    let r = client()
        .post(server.url("/completion"))
        .json(&json!({"prompt": long, "n_predict": 4, "temperature": 0, "stream": true, "return_progress": true}))
        .send()
        .unwrap();
    let (events, _) = read_sse(r, usize::MAX);
    let events: Vec<Value> = events
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let progress: Vec<&Value> = events
        .iter()
        .filter_map(|e| e.get("prompt_progress"))
        .collect();
    assert!(
        progress.len() >= 2,
        "a prompt of several chunks reports each: {events:?}"
    );
    let processed: Vec<u64> = progress
        .iter()
        .map(|p| p["processed"].as_u64().unwrap())
        .collect();
    assert!(processed.windows(2).all(|w| w[0] < w[1]), "{processed:?}");
    assert_eq!(
        processed.last(),
        progress.last().unwrap()["total"].as_u64().as_ref()
    );
    for e in events
        .iter()
        .filter(|e| e["stop"] == false && e.get("prompt_progress").is_none())
    {
        assert!(!e["tokens"].as_array().unwrap().is_empty(), "{e}");
    }
    assert_eq!(events.last().unwrap()["stop"], true);
}

#[test]
fn slots_show_a_busy_slots_h2o_state_and_cors_and_templates_answer() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(SHAPE);
    let slots = get_json(&server, "/slots");
    assert_eq!(slots.as_array().unwrap().len(), 4);
    assert!(slots
        .as_array()
        .unwrap()
        .iter()
        .all(|s| s["is_processing"] == false));
    // llama-server's params: an idle slot shows the server's defaults
    let params = &slots[0]["params"];
    assert_eq!(
        (&params["temperature"], &params["top_k"]),
        (&json!(0.8f32), &json!(40)),
        "{params}"
    );

    // a long stream holds its slot while /slots is read
    let long = format!("{}Tell me more.", long_text(400));
    let r = client()
        .post(server.url("/v1/chat/completions"))
        .json(&json!({"messages": user(&long), "max_tokens": 400, "stream": true, "temperature": 0.8, "seed": 1}))
        .send()
        .unwrap();
    let (first, _rest) = read_sse(r, 2);
    assert_eq!(first.len(), 2);
    // the engine shows a step's end once the step is over: wait for the prompt's last chunk
    let mut busy = Vec::new();
    wait_until(
        "/slots shows the prompt evaluated",
        Duration::from_secs(300),
        || {
            busy = get_json(&server, "/slots")
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| s["is_processing"] == true)
                .cloned()
                .collect();
            busy.len() == 1 && busy[0]["h2o"]["prompt_processed"] == busy[0]["h2o"]["prompt_tokens"]
        },
    );
    let h2o = &busy[0]["h2o"];
    assert_eq!(h2o["memory_size"], 32, "{h2o}");
    assert!(
        h2o["sparse_chunks"].as_u64().unwrap() > 0,
        "a 400-token prompt in chunks of 64: {h2o}"
    );
    assert!(
        busy[0]["next_token"]["n_decoded"].as_u64().unwrap() >= 1,
        "{busy:?}"
    );
    // and a busy one its job's
    let params = &busy[0]["params"];
    assert_eq!(
        (&params["seed"], &params["n_predict"]),
        (&json!(1), &json!(400)),
        "{params}"
    );
    drop(_rest);

    // CORS: a browser's preflight, and the header on an answer
    let r = client()
        .request(reqwest::Method::OPTIONS, server.url("/v1/chat/completions"))
        .header("Origin", "http://example.org")
        .header("Access-Control-Request-Method", "POST")
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["access-control-allow-origin"],
        "http://example.org"
    );
    let r = client().get(server.url("/health")).send().unwrap();
    assert_eq!(r.headers()["access-control-allow-origin"], "*");
    // on the wire, header names in Title-Case, as llama-server writes them
    let raw = {
        use std::io::{Read, Write};
        let addr = server.base.trim_start_matches("http://");
        let mut tcp = std::net::TcpStream::connect(addr).unwrap();
        write!(tcp, "OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nOrigin: http://a.b\r\nConnection: close\r\n\r\n").unwrap();
        let mut text = String::new();
        tcp.read_to_string(&mut text).unwrap();
        text
    };
    assert!(
        raw.contains("\r\nAccess-Control-Allow-Origin: http://a.b\r\n"),
        "{raw}"
    );

    // /apply-template: the chat prompt, with a final assistant message as a prefill
    let (status, v) = post(
        &server,
        "/apply-template",
        &json!({"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Well,"}]}),
    );
    assert_eq!(status, 200, "{v}");
    let prompt = v["prompt"].as_str().unwrap();
    assert!(
        prompt.contains("Hi there") && prompt.ends_with("assistant\nWell,"),
        "{prompt:?}"
    );

    // --no-slots: 501, llama-server's not_supported_error
    let other = Server::start(&[SHAPE, &["--no-slots"]].concat());
    let r = client().get(other.url("/slots")).send().unwrap();
    assert_eq!(r.status(), 501);
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["type"], "not_supported_error");
    wait_until("the busy slot is freed", Duration::from_secs(300), || {
        get_json(&server, "/slots")
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["is_processing"] == false)
    });
}

#[test]
fn a_saved_slot_restored_elsewhere_continues_its_conversation() {
    let _engine = common::one_engine_at_a_time();
    let dir = std::env::temp_dir().join(format!("h2o-slots-{}", std::process::id()));
    let server = Server::start(&[SHAPE, &["--slot-save-path", dir.to_str().unwrap()]].concat());
    let first = format!("{}What did the harbour master count?", long_text(300));
    let greedy = |prompt: &str, cache: bool| {
        let (status, v) = post(
            &server,
            "/completion",
            &json!({"prompt": prompt, "n_predict": 8, "temperature": 0, "cache_prompt": cache}),
        );
        assert_eq!(status, 200, "{v}");
        v
    };
    let r1 = greedy(&first, true);
    let slot = r1["id_slot"].as_u64().unwrap();
    let action = |id: u64, action: &str, body: Value| {
        let r = client()
            .post(server.url(&format!("/slots/{id}?action={action}")))
            .json(&body)
            .send()
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json::<Value>().unwrap())
    };
    let (status, saved) = action(slot, "save", json!({"filename": "conversation.bin"}));
    assert_eq!(status, 200, "{saved}");
    // with H2O, what a next turn can reuse: whole chunks of 64 before the prompt's dense tail
    let n_saved = saved["n_saved"].as_u64().unwrap();
    assert!(n_saved >= 256 && n_saved % 64 == 0, "{saved}");
    assert!(saved["n_written"].as_u64().unwrap() > 0, "{saved}");
    let (status, erased) = action(slot, "erase", json!({}));
    assert_eq!(status, 200, "{erased}");
    assert_eq!(erased["n_erased"], n_saved);
    let other = (slot + 1) % 4;
    let (status, restored) = action(other, "restore", json!({"filename": "conversation.bin"}));
    assert_eq!(status, 200, "{restored}");
    assert_eq!(restored["n_restored"], n_saved);
    let slots = get_json(&server, "/slots");
    assert_eq!(slots[other as usize]["n_past"], n_saved, "{slots}");
    assert_eq!(slots[slot as usize]["n_past"], 0, "{slots}");

    // the conversation's next turn goes to the restored slot and reuses its prefix; its answer
    // is the one a fresh evaluation of the whole prompt gives
    let next = format!("{first}{} And then?", r1["content"].as_str().unwrap());
    let reused = greedy(&next, true);
    assert_eq!(reused["id_slot"], other, "{reused}");
    assert!(
        reused["timings"]["cache_n"].as_u64().unwrap() > 0,
        "{reused}"
    );
    let fresh = greedy(&next, false);
    assert_eq!(fresh["timings"]["cache_n"], 0, "{fresh}");
    assert_eq!(reused["content"], fresh["content"]);

    // bad input: 400 naming the problem; no --slot-save-path: 501
    for (id, act, body) in [
        (other, "restore", json!({"filename": "missing.bin"})),
        (other, "save", json!({"filename": "../escape.bin"})),
        (other, "jump", json!({})),
        (99, "erase", json!({})),
    ] {
        let (status, v) = action(id, act, body);
        assert_eq!(status, 400, "{act}: {v}");
        assert!(v["error"]["message"].is_string());
    }
    let plain = Server::start(SHAPE);
    let r = client()
        .post(plain.url("/slots/0?action=save"))
        .json(&json!({"filename": "x.bin"}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 501);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn n_choices_come_back_together() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(SHAPE);
    let (status, v) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": user("Name a fruit."), "n": 3, "max_tokens": 4, "seed": 5}),
    );
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
        assert_eq!(c["message"]["role"], "assistant");
        assert!(c["message"]["content"].is_string(), "{v}");
        assert!(c["finish_reason"].is_string(), "{v}");
    }
    let completion = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(
        (3..=12).contains(&completion),
        "three choices of 1 to 4 tokens: {v}"
    );

    // the legacy endpoint: the first prompt's choices, then the second's
    let (status, v) = post(
        &server,
        "/v1/completions",
        &json!({"prompt": ["One", "Two"], "n": 2, "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4, "{v}");

    // a stream carries one choice
    let (status, v) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": user("Hi"), "n": 2, "stream": true}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "n");
}

#[test]
fn context_shift_lets_a_generation_go_past_its_slot() {
    let _engine = common::one_engine_at_a_time();
    // a slot of 256 tokens, a prompt of about 200: 96 more tokens need a shift
    let args = ["-c", "256", "-np", "1", "--context-shift"];
    let server = Server::start(&args);
    let prompt = long_text(200);
    let body = json!({"prompt": prompt, "n_predict": 96, "temperature": 0});
    let (status, v) = post(&server, "/completion", &body);
    assert_eq!(status, 200, "{v}");
    let prompt_n = v["timings"]["prompt_n"].as_u64().unwrap();
    assert!(prompt_n > 160 && prompt_n < 256, "{v}");
    assert_eq!(v["truncated"], true, "{v}");
    let predicted = v["timings"]["predicted_n"].as_u64().unwrap();
    // the model may end the text itself; without a shift it could not pass the slot
    assert!(
        predicted == 96 || v["stop_type"] == "eos",
        "{predicted} tokens: {v}"
    );
    drop(server);

    // without it, the same request ends when the slot is full
    let server = Server::start(&["-c", "256", "-np", "1"]);
    let (status, v) = post(&server, "/completion", &body);
    assert_eq!(status, 200, "{v}");
    if v["stop_type"] != "eos" {
        assert_eq!(v["truncated"], true, "{v}");
        // the last token is sampled from the full slot, not stored
        assert!(
            v["timings"]["predicted_n"].as_u64().unwrap() + prompt_n <= 257,
            "{v}"
        );
    }
    drop(server);

    // H2O keeps its memory sets by position: the two are refused together, naming the flag
    refused_at_start(
        &["--context-shift", "--h2o-local", "16", "--h2o-heavy", "16"],
        "--context-shift",
    );
}

#[test]
fn post_sampling_probs_and_json_prompts_follow_llama_server() {
    let _engine = common::one_engine_at_a_time();
    let server = Server::start(SHAPE);
    let text = "I believe the meaning of life is";
    // greedy: the distribution the draw saw has the chosen token alone, at 1; the rest follow
    // by likelihood at 0
    let (status, v) = post(
        &server,
        "/completion",
        &json!({"prompt": text, "n_predict": 3, "n_probs": 5, "temperature": 0, "post_sampling_probs": true}),
    );
    assert_eq!(status, 200, "{v}");
    let (_, raw) = post(
        &server,
        "/completion",
        &json!({"prompt": text, "n_predict": 3, "n_probs": 5, "temperature": 0}),
    );
    for (p, r) in v["completion_probabilities"]
        .as_array()
        .unwrap()
        .iter()
        .zip(raw["completion_probabilities"].as_array().unwrap())
    {
        assert_eq!(p["prob"], 1.0, "{p}");
        let top = p["top_probs"].as_array().unwrap();
        assert_eq!(top.len(), 5, "{p}");
        assert_eq!(top[0]["id"], p["id"]);
        assert!(top[1..].iter().all(|t| t["prob"] == 0.0), "{p}");
        // the same ranking as the model's own distribution
        let ids = |list: &Value, key: &str| -> Vec<i64> {
            list[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["id"].as_i64().unwrap())
                .collect()
        };
        assert_eq!(ids(p, "top_probs"), ids(r, "top_logprobs"));
    }
    // sampled with top-k 3: three tokens share it all
    let (_, v) = post(
        &server,
        "/completion",
        &json!({"prompt": text, "n_predict": 2, "n_probs": 5, "temperature": 1.0, "top_k": 3, "top_p": 1.0, "seed": 7, "post_sampling_probs": true}),
    );
    for p in v["completion_probabilities"].as_array().unwrap() {
        let probs: Vec<f64> = p["top_probs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["prob"].as_f64().unwrap())
            .collect();
        assert_eq!(probs.len(), 3, "top-k kept three: {p}");
        assert!((probs.iter().sum::<f64>() - 1.0).abs() < 1e-4, "{probs:?}");
    }

    // llama-server's JSON prompt object: the same as its text; media is refused by name
    let greedy = |prompt: Value| {
        post(
            &server,
            "/completion",
            &json!({"prompt": prompt, "n_predict": 4, "temperature": 0}),
        )
    };
    let (_, by_text) = greedy(json!(text));
    let (status, by_object) = greedy(json!({"prompt_string": text}));
    assert_eq!(status, 200, "{by_object}");
    assert_eq!(by_object["content"], by_text["content"]);
    let (status, both) = greedy(json!([{"prompt_string": text}, text]));
    assert_eq!(status, 200, "{both}");
    assert_eq!(both[0]["content"], both[1]["content"]);
    let (status, e) = greedy(json!({"prompt_string": text, "multimodal_data": ["AA=="]}));
    assert_eq!(status, 400, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("multimodal_data"),
        "{e}"
    );
}

#[test]
fn a_unified_cache_lets_one_slot_use_what_the_others_leave() {
    let _engine = common::one_engine_at_a_time();
    // 4 slots sharing 512 cells: a request of 300 tokens fits, which 512 / 4 would not
    let server = Server::start(&["-c", "512", "-np", "4", "--kv-unified", "-v"]);
    let greedy = |prompt: String| {
        post(
            &server,
            "/completion",
            &json!({"prompt": prompt, "n_predict": 8, "temperature": 0}),
        )
    };
    let (status, v) = greedy(long_text(280));
    assert_eq!(status, 200, "{v}");
    assert!(v["timings"]["prompt_n"].as_u64().unwrap() > 128, "{v}");
    assert_eq!(v["generation_settings"]["n_ctx"], 512);
    // two requests at once leave two slots holding about 200 cells each; a third prompt of
    // about 380 tokens sharing neither's prefix finds room only once the other idle slot's
    // cached tokens go too
    let (a, b) = std::thread::scope(|scope| {
        let a = scope.spawn(|| greedy(format!("First. {}", long_text(190))));
        let b = scope.spawn(|| greedy(format!("Second. {}", long_text(190))));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert_eq!((a.0.as_u16(), b.0.as_u16()), (200, 200), "{} {}", a.1, b.1);
    assert_ne!(a.1["id_slot"], b.1["id_slot"], "two slots at once");
    let (status, c) = greedy(format!("Third. {}", long_text(370)));
    assert_eq!(status, 200, "{c}");
    assert!(c["timings"]["prompt_n"].as_u64().unwrap() > 330, "{c}");
    // with --verbose, an OpenAI answer carries llama-server's `__verbose`: the prompt's text
    let (status, c) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": user("Hi"), "max_tokens": 2, "temperature": 0}),
    );
    assert_eq!(status, 200, "{c}");
    let rendered = c["__verbose"]["prompt"].as_str().unwrap_or_default();
    assert!(rendered.contains("<|im_start|>user\nHi<|im_end|>"), "{c}");
    drop(server);

    // H2O keeps each slot's state with its own stream: refused at start, naming the flag
    refused_at_start(
        &["--kv-unified", "--h2o-local", "16", "--h2o-heavy", "16"],
        "--kv-unified",
    );
}

#[test]
fn sparse_decode_reads_fewer_keys_and_says_how_many() {
    let _engine = common::one_engine_at_a_time();
    // slots of 1024 tokens; a step reads the first block, the last 16 positions and 64 chosen
    // (or a request's own budget)
    let mut args = SHAPE.to_vec();
    args.extend(["--h2o-decode", "sparse", "--h2o-decode-budget", "64"]);
    let server = Server::start(&args);
    let body = json!({"prompt": long_text(600), "n_predict": 8, "temperature": 0});
    let (status, v) = post(&server, "/completion", &body);
    assert_eq!(status, 200, "{v}");
    let timings = &v["timings"];
    let prompt_n = timings["prompt_n"].as_f64().unwrap();
    let keys = timings["h2o_decode_keys_per_step"].as_f64().unwrap();
    assert!(
        keys > 64.0 && keys < 16.0 + 32.0 + 64.0 + 16.0,
        "sparse: {keys} keys a step after {prompt_n} prompt tokens: {v}"
    );
    assert!(!v["content"].as_str().unwrap().is_empty(), "{v}");

    // a request asks for its own decode: full attention reads every cached position, a larger
    // budget more than the server's
    let mut own = body.clone();
    own["h2o_decode"] = json!("full");
    let (status, v) = post(&server, "/completion", &own);
    assert_eq!(status, 200, "{v}");
    let full_keys = v["timings"]["h2o_decode_keys_per_step"].as_f64().unwrap();
    assert!(
        full_keys > prompt_n,
        "full for one request: {full_keys} keys a step: {v}"
    );
    let mut own = body.clone();
    own["h2o_decode_budget"] = json!(256);
    let (status, v) = post(&server, "/completion", &own);
    assert_eq!(status, 200, "{v}");
    let own_keys = v["timings"]["h2o_decode_keys_per_step"].as_f64().unwrap();
    assert!(
        own_keys > keys + 128.0 && own_keys < full_keys,
        "budget 256 for one request: {own_keys} keys a step (64: {keys}, full: {full_keys}): {v}"
    );
    // and the next request without the field decodes with the server's budget again
    let (_, v) = post(&server, "/completion", &body);
    let again = v["timings"]["h2o_decode_keys_per_step"].as_f64().unwrap();
    assert_eq!(again, keys, "{v}");
    drop(server);

    // a budget that follows coverage: a step takes only what holds a tenth of the estimated
    // attention, which llama.cpp counts (fewer than the budget of 256, more than the sinks and
    // the window alone)
    let mut args = SHAPE.to_vec();
    args.extend(["--h2o-decode", "sparse", "--h2o-decode-budget", "256"]);
    args.extend(["--h2o-decode-coverage", "0.1"]);
    let server = Server::start(&args);
    let (status, v) = post(&server, "/completion", &body);
    assert_eq!(status, 200, "{v}");
    let covering = v["timings"]["h2o_decode_keys_per_step"].as_f64().unwrap();
    assert!(
        covering < own_keys && covering > 16.0 + 16.0,
        "coverage 0.1 of 256: {covering} keys a step (budget 256: {own_keys}): {v}"
    );
    drop(server);

    // full-attention decode reads every cached position
    let server = Server::start(SHAPE);
    let (_, v) = post(&server, "/completion", &body);
    let keys = v["timings"]["h2o_decode_keys_per_step"].as_f64().unwrap();
    assert!(keys > prompt_n, "full: {keys} keys a step: {v}");
    // a server that decodes with full attention keeps no key sketches: sparse decode for one
    // request is refused, naming the field
    let mut own = body.clone();
    own["h2o_decode"] = json!("sparse");
    let (status, v) = post(&server, "/completion", &own);
    assert_eq!(status, 400, "{v}");
    assert!(v.to_string().contains("h2o_decode"), "{v}");
    drop(server);

    // a budget beyond a slot's context is refused at start, naming the flag
    let mut args = SHAPE.to_vec();
    args.extend(["--h2o-decode", "sparse", "--h2o-decode-budget", "4096"]);
    refused_at_start(&args, "--h2o-decode-budget");
    let mut args = SHAPE.to_vec();
    args.extend(["--h2o-decode", "sparse", "--h2o-decode-coverage", "0"]);
    refused_at_start(&args, "--h2o-decode-coverage");
    // and sparse decode without H2O on, which the server dropped before
    refused_at_start(&["--h2o", "off", "--h2o-decode", "sparse"], "need H2O on");
}

/// Left to decide with the model's own context (`-c 0`, the default), the server keeps full
/// attention for a model trained on fewer tokens than H2O pays on, and turns H2O on for the same
/// model trained on 4,096: the training context, which only the loaded model tells, decides.
#[test]
fn a_model_trained_on_a_short_context_keeps_full_attention() {
    let _engine = one_engine_at_a_time();
    let dir = scratch("server-training-context");
    // an -ub for H2O's chunks above full attention's -b (2,048) starts the short model too
    for (n_ctx_train, args, h2o_on) in [
        (2048_u32, &["-np", "1"][..], false),
        (2048, &["-np", "1", "-ub", "4096"], false),
        (4096, &["-np", "1"], true),
    ] {
        let path = dir.join(format!("llama-{n_ctx_train}.gguf"));
        let mut tiny = tiny_models::llama_gqa();
        tiny.gguf.set("llama.context_length", n_ctx_train);
        tiny.gguf.write(&path).unwrap();
        let server = Server::start_model(path.to_str().unwrap(), args, None);
        let setup = server.log_text();
        assert!(
            setup.contains(&format!("1 slot x {n_ctx_train} tokens")),
            "{setup}"
        );
        let says = if h2o_on {
            "select=coverage"
        } else {
            "full attention (H2O left off"
        };
        assert!(setup.contains(says), "{n_ctx_train}: {setup}");
        let body = json!({"prompt": "Hello there", "n_predict": 2, "temperature": 0});
        let (status, v) = post(&server, "/completion", &body);
        assert_eq!(status, 200, "{v}");
        let policy = if h2o_on { "coverage" } else { "full" };
        assert_eq!(v["timings"]["h2o_policy"], policy, "{n_ctx_train}: {v}");
    }
}

/// Left to decide, the server starts with H2O on (the setup line says so): the recommended
/// configuration, whose prompts of more than a chunk run sparse, and a conversation's next turn
/// still reuses its cached prefix.
#[test]
fn a_server_left_to_decide_runs_h2o_and_reuses_a_conversations_prefix() {
    let _engine = one_engine_at_a_time();
    let server = Server::start(&["-c", "8192", "-np", "1"]);
    let setup = server.log.lock().unwrap().join("\n");
    assert!(setup.contains("select=coverage"), "{setup}");
    assert!(setup.contains("decode=sparse"), "{setup}");
    assert!(setup.contains("on by itself"), "{setup}");
    // about 1,500 tokens: two chunks of 1,024, the second attending to a memory
    let first = h2o_llama::demo::prompt(50);
    let body = json!({"prompt": first, "n_predict": 4, "temperature": 0});
    let (status, v) = post(&server, "/completion", &body);
    assert_eq!(status, 200, "{v}");
    let t = &v["timings"];
    assert_eq!(t["h2o_policy"], "coverage", "{t}");
    assert_eq!(t["h2o_memory_size"], 512, "{t}");
    assert_eq!(
        (&t["h2o_chunks"], &t["h2o_sparse_chunks"]),
        (&2.into(), &1.into()),
        "{t}"
    );
    // the next turn: the first chunk comes from the cache
    let next = format!("{first} the old mill.\nQuestion: Who moved crate A-104?\nAnswer:");
    let body = json!({"prompt": next, "n_predict": 4, "temperature": 0});
    let (status, v) = post(&server, "/completion", &body);
    assert_eq!(status, 200, "{v}");
    assert!(v["tokens_cached"].as_u64().unwrap() >= 1024, "{v}");
}

/// `--rpc` as llama-server spells it: a server that is not there stops h2o-server at start (exit
/// 3), naming it, before llama.cpp's RPC client (which would end the process) connects.
#[test]
fn an_rpc_server_that_is_not_there_stops_the_server_at_start() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let server = format!("127.0.0.1:{port}");
    refused_at_start(
        &["--rpc", &server, "--n-gpu-layers", "99"],
        &format!("RPC server {server}: cannot connect"),
    );
}
