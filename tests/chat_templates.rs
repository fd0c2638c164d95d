//! Jinja chat templates with tool calls (`ChatTemplates`, common/'s chat library through patch
//! 0024), on the default model: its own template renders as llama.cpp's built-in renderer does;
//! with `examples/templates/chatml-tools.jinja` in its place, a required tool call is sampled
//! through the template's grammar and parsed back, whole and in streamed pieces; and what
//! llama.cpp refuses comes back as an error with its reason.
#![cfg(not(feature = "stock"))]

mod common;

use std::sync::Arc;

use h2o_llama::{
    ChatMessage, ChatTemplates, Error, Model, ModelParams, Sampler, SamplerConfig, Session,
    SessionConfig,
};
use serde_json::{json, Value};

fn model() -> Arc<Model> {
    Arc::new(Model::load(common::model_path(), &ModelParams::default()).unwrap())
}

fn tools_template() -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("examples/templates/chatml-tools.jinja");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `tests/data/weather-call.json`: a tool, and a conversation that calls it once before asking.
fn weather_request(tool_choice: &str) -> Value {
    let mut request: Value = serde_json::from_str(include_str!("data/weather-call.json")).unwrap();
    request["tool_choice"] = json!(tool_choice);
    request
}

#[test]
fn the_models_own_template_renders_as_llama_cpps_built_in_one() {
    let m = model();
    let templates = ChatTemplates::new(Arc::clone(&m), None).unwrap();
    let (prompt, mut parser) = templates
        .apply(&json!({"messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}
        ]}))
        .unwrap();
    let built_in = m
        .apply_chat_template(
            &[
                ChatMessage::new("system", "You are a helpful assistant."),
                ChatMessage::new("user", "What is the capital of France?"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(prompt.prompt, built_in);
    let info = templates.info().unwrap();
    assert_eq!(Some(info.source), m.chat_template());
    assert_eq!(info.caps.get("supports_tool_calls"), Some(&false));
    assert_eq!(info.caps.get("supports_system_role"), Some(&true));
    let with_tools = ChatTemplates::new(Arc::clone(&m), Some(&tools_template())).unwrap();
    assert_eq!(
        with_tools.info().unwrap().caps.get("supports_tool_calls"),
        Some(&true)
    );
    assert!(
        prompt.grammar.is_empty(),
        "no tools, no schema: {:?}",
        prompt.grammar
    );
    // without tools the reply is all content
    let (reply, deltas) = parser.update("The capital is Paris.", false).unwrap();
    assert_eq!(reply.content, "The capital is Paris.");
    assert!(reply.tool_calls.is_empty());
    assert_eq!(deltas.len(), 1);
    assert_eq!(deltas[0].content, "The capital is Paris.");
}

#[test]
fn a_required_tool_call_is_sampled_in_the_templates_format_and_parsed_back() {
    let m = model();
    let templates = ChatTemplates::new(Arc::clone(&m), Some(&tools_template())).unwrap();
    let (prompt, mut parser) = templates.apply(&weather_request("required")).unwrap();
    assert!(prompt.prompt.contains("get_weather"), "{}", prompt.prompt);
    assert!(
        prompt.prompt.ends_with("<|im_start|>assistant\n"),
        "{}",
        prompt.prompt
    );
    assert!(!prompt.grammar.is_empty() && !prompt.grammar_lazy);
    assert!(!prompt.grammar_prefill_tokens.is_empty());

    let config = SamplerConfig {
        grammar: Some(prompt.grammar.clone()),
        grammar_triggers: prompt.grammar_triggers(),
        grammar_prefill: prompt.grammar_prefill_tokens.clone(),
        ..SamplerConfig::greedy()
    };
    let mut sampler = Sampler::for_model(&m, &config).unwrap();
    let mut session = Session::new(
        &m,
        SessionConfig {
            n_ctx: 2048,
            ..SessionConfig::default()
        },
    )
    .unwrap();
    let tokens = m.tokenize(&prompt.prompt, true, true).unwrap();
    // the reply streams through the parser piece by piece, as the server's stream does
    let mut text = String::new();
    let mut streamed_arguments = String::new();
    let mut streamed_names = Vec::new();
    let out = session
        .generate(&tokens, &mut sampler, 64, |piece| {
            text.push_str(piece);
            let (_, deltas) = parser.update(&text, true).unwrap();
            for d in deltas {
                if let Some(call) = d.tool_call {
                    assert_eq!(d.tool_call_index, Some(0));
                    if !call.name.is_empty() {
                        streamed_names.push(call.name);
                    }
                    streamed_arguments.push_str(&call.arguments);
                }
            }
            true
        })
        .unwrap();
    let (reply, _) = parser.update(&out.text, false).unwrap();
    assert_eq!(reply.tool_calls.len(), 1, "{:?}", out.text);
    let call = &reply.tool_calls[0];
    assert_eq!(call.name, "get_weather");
    assert_eq!(
        call.id.len(),
        32,
        "llama-server's tool call ids: {:?}",
        call.id
    );
    let arguments: Value = serde_json::from_str(&call.arguments)
        .unwrap_or_else(|e| panic!("arguments {:?}: {e}", call.arguments));
    assert!(arguments["city"].is_string(), "{arguments}");
    // the streamed pieces add up to the whole call
    assert_eq!(streamed_names, ["get_weather"]);
    assert_eq!(streamed_arguments, call.arguments);
}

#[test]
fn an_optional_tool_call_gets_a_lazy_grammar_and_no_tools_get_none() {
    let m = model();
    let templates = ChatTemplates::new(Arc::clone(&m), Some(&tools_template())).unwrap();
    let (auto, _) = templates.apply(&weather_request("auto")).unwrap();
    assert!(
        auto.grammar_lazy,
        "tool_choice auto: the model may answer in text"
    );
    let triggers = auto.grammar_triggers().unwrap();
    assert!(
        !triggers.patterns.is_empty() || !triggers.tokens.is_empty(),
        "a lazy grammar needs a trigger"
    );
    let config = SamplerConfig {
        grammar: Some(auto.grammar.clone()),
        grammar_triggers: Some(triggers),
        ..SamplerConfig::greedy()
    };
    Sampler::for_model(&m, &config).unwrap();

    let (none, _) = templates.apply(&weather_request("none")).unwrap();
    assert!(
        none.grammar.is_empty(),
        "tool_choice none: {:?}",
        none.grammar
    );
}

#[test]
fn what_llama_cpp_refuses_is_an_error_with_its_reason() {
    let m = model();
    let templates = ChatTemplates::new(Arc::clone(&m), Some(&tools_template())).unwrap();
    let refused = |request: Value, reason: &str| {
        let e = templates.apply(&request).expect_err(reason);
        assert!(matches!(e, Error::InvalidConfig(_)), "{e}");
        assert!(e.to_string().contains(reason), "{e}");
    };
    refused(weather_request("sometimes"), "Invalid tool_choice");
    refused(json!({"messages": "hello"}), "messages");
    refused(json!({"messages": [{"content": "no role"}]}), "role");
    let mut grammar_and_tools = weather_request("auto");
    grammar_and_tools["grammar"] = json!("root ::= \"a\"");
    refused(grammar_and_tools, "grammar with tools");

    let e = ChatTemplates::new(Arc::clone(&m), Some("{% if %}")).expect_err("bad Jinja");
    assert!(e.to_string().contains("chat template"), "{e}");
    let e = ChatTemplates::new(m, Some("a\0b")).expect_err("NUL");
    assert!(e.to_string().contains("NUL"), "{e}");
}
