//! Tool calls through the Jinja chat templates, end to end on the real model: a tool call
//! whole and streamed in OpenAI's delta shape (the pieces add up to the whole call), a tool
//! result sent back, `--jinja` rendering plain chats as the built-in template does, and the
//! 400s for tools the template cannot carry, a bad `tool_choice` and a grammar beside tools.

use std::path::Path;

use serde_json::{json, Value};

mod common;
use common::*;

fn template_file() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/templates/chatml-tools.jinja")
        .display()
        .to_string()
}

fn with_template(extra: &[&str]) -> Server {
    let file = template_file();
    let mut args: Vec<&str> = SHAPE.to_vec();
    args.extend(["--chat-template-file", &file]);
    args.extend(extra);
    Server::start(&args)
}

/// `tests/data/weather-call.json`: a tool, and a conversation that calls it once before asking.
fn weather_call() -> Value {
    serde_json::from_str(include_str!("../../tests/data/weather-call.json")).unwrap()
}

fn weather_tool() -> Value {
    weather_call()["tools"].clone()
}

fn weather_messages() -> Value {
    weather_call()["messages"].clone()
}

fn weather_request(stream: bool) -> Value {
    json!({
        "messages": weather_messages(),
        "tools": weather_tool(),
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 48,
        "stream": stream
    })
}

#[test]
fn a_tool_call_comes_back_whole_and_streamed_in_openais_shapes() {
    let _engine = common::one_engine_at_a_time();
    let server = with_template(&[]);
    // /props shows the template and what it supports, as llama-server's
    let props = get_json(&server, "/props");
    assert_eq!(
        props["chat_template_caps"]["supports_tool_calls"], true,
        "{props}"
    );
    assert!(props["chat_template"]
        .as_str()
        .unwrap()
        .contains("tool_call"));
    let (status, v) = post(&server, "/v1/chat/completions", &weather_request(false));
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let message = &choice["message"];
    assert_eq!(message["content"], Value::Null, "{v}");
    let calls = message["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert!(!calls[0]["id"].as_str().unwrap().is_empty());
    let arguments: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(arguments["city"].is_string(), "{arguments}");

    // the same request streamed: the first piece of the call has its id, type and name, the
    // others only arguments; together they are the whole call
    let r = client()
        .post(server.url("/v1/chat/completions"))
        .json(&weather_request(true))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let (events, _) = read_sse(r, 1000);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let mut arguments = String::new();
    let mut names = Vec::new();
    let mut ids = Vec::new();
    for c in &chunks {
        let delta = &c["choices"][0]["delta"];
        assert!(
            delta.get("content").is_none_or(Value::is_null),
            "a tool call's stream has no text: {c}"
        );
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            assert_eq!(call["index"], 0, "{c}");
            if let Some(id) = call.get("id") {
                ids.push(id.as_str().unwrap().to_string());
                assert_eq!(call["type"], "function");
            }
            if let Some(name) = call["function"].get("name") {
                names.push(name.as_str().unwrap().to_string());
            }
            arguments.push_str(call["function"]["arguments"].as_str().unwrap());
        }
    }
    assert_eq!(names, ["get_weather"]);
    assert_eq!(ids.len(), 1, "one id, on the first piece");
    assert_eq!(
        arguments,
        calls[0]["function"]["arguments"].as_str().unwrap(),
        "greedy: the stream's call is the whole answer's"
    );
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{last}");

    // OpenAI's tool_choice naming one function: that tool alone goes to the template, called
    let mut named = weather_request(false);
    named["tools"]
        .as_array_mut()
        .unwrap()
        .push(json!({"type": "function", "function": {"name": "get_time", "parameters": {}}}));
    named["tool_choice"] = json!({"type": "function", "function": {"name": "get_weather"}});
    let (status, v) = post(&server, "/v1/chat/completions", &named);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "get_weather",
        "{v}"
    );

    // the tool's result goes back as a tool message, and the conversation goes on in text
    let mut messages = weather_messages();
    let messages_list = messages.as_array_mut().unwrap();
    messages_list.push(message.clone());
    messages_list.push(json!({
        "role": "tool",
        "tool_call_id": calls[0]["id"],
        "content": "25 degrees, sunny"
    }));
    let (status, v) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": messages, "tools": weather_tool(), "tool_choice": "none",
                "temperature": 0, "max_tokens": 16}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
    assert!(!v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
}

#[test]
fn tools_the_template_cannot_carry_and_bad_tool_fields_are_400() {
    let _engine = common::one_engine_at_a_time();
    // the model's own template (SmolLM2's ChatML) has no tool calls
    let server = Server::start(SHAPE);
    let props = get_json(&server, "/props");
    assert_eq!(
        props["chat_template_caps"]["supports_tool_calls"], false,
        "{props}"
    );
    let (status, v) = post(&server, "/v1/chat/completions", &weather_request(false));
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["param"], "tools");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("does not support tool calls"), "{message}");
    assert!(message.contains("--chat-template-file"), "{message}");
    // the server goes on answering
    let (status, _) = post(
        &server,
        "/v1/chat/completions",
        &json!({"messages": user("Hi"), "max_tokens": 2}),
    );
    assert_eq!(status, 200);
    drop(server);

    let server = with_template(&[]);
    for (change, param) in [
        (json!({"tool_choice": "sometimes"}), "tools"),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": {"type": "tool"}}), "tool_choice"),
        (json!({"grammar": "root ::= \"a\""}), "grammar"),
        (json!({"tools": [{"type": "function"}]}), "tools"),
    ] {
        let mut body = weather_request(false);
        for (k, v) in change.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = post(&server, "/v1/chat/completions", &body);
        assert_eq!(status, 400, "{change}: {v}");
        assert_eq!(v["error"]["param"], param, "{change}: {v}");
    }
    drop(server);

    let server = Server::start(&[SHAPE, &["--no-jinja"]].concat());
    let (status, v) = post(&server, "/v1/chat/completions", &weather_request(false));
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--no-jinja"),
        "{v}"
    );
}

#[test]
fn with_jinja_plain_chats_render_as_the_built_in_template_does() {
    let _engine = common::one_engine_at_a_time();
    let messages = json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital"}
    ]);
    let body = json!({"messages": messages, "temperature": 0, "max_tokens": 8});
    let answer = |args: &[&str]| {
        let server = Server::start(&[SHAPE, args].concat());
        let (status, template) = post(&server, "/apply-template", &json!({"messages": messages}));
        assert_eq!(status, 200, "{template}");
        let (status, v) = post(&server, "/v1/chat/completions", &body);
        assert_eq!(status, 200, "{v}");
        (
            template["prompt"].clone(),
            v["choices"][0]["message"]["content"].clone(),
        )
    };
    let built_in = answer(&[]);
    let jinja = answer(&["--jinja"]);
    assert_eq!(jinja, built_in);
}
