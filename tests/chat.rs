//! Chat prompts through the model's own template (`Model::apply_chat_template`), as the server's
//! `/v1/chat/completions` will render them: the exact ChatML text llama.cpp renders for the
//! default model, a greedy answer through it, and the errors.
#![cfg(not(feature = "stock"))]

mod common;

use h2o_llama::{ChatMessage, Error, Sampler, SamplerConfig, Session, SessionConfig};

#[test]
fn the_default_models_chatml_template_renders_a_conversation() {
    let m = common::model();
    let template = m
        .chat_template()
        .expect("SmolLM2-Instruct ships a chat template");
    assert!(template.contains("<|im_start|>"), "{template}");
    let messages = [
        ChatMessage::new("system", "You are a helpful assistant."),
        ChatMessage::new("user", "What is the capital of France?"),
    ];
    let prompt = m.apply_chat_template(&messages, true).unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let without = m.apply_chat_template(&messages, false).unwrap();
    assert_eq!(prompt, format!("{without}<|im_start|>assistant\n"));

    // the rendered prompt is what the model answers: greedy, it names the city
    let mut s = Session::new(m, SessionConfig::default()).unwrap();
    let tokens = m.tokenize(&prompt, true, true).unwrap();
    let mut sampler = Sampler::new(&SamplerConfig::greedy()).unwrap();
    let answer = s.generate(&tokens, &mut sampler, 16, |_| true).unwrap();
    assert!(answer.text.contains("Paris"), "{:?}", answer.text);
}

#[test]
fn bad_chat_prompts_are_errors() {
    let m = common::model();
    let e = m.apply_chat_template(&[], true).unwrap_err();
    assert!(
        matches!(&e, Error::ChatTemplate(why) if why.contains("at least one message")),
        "{e}"
    );
    let e = m
        .apply_chat_template(&[ChatMessage::new("user", "a\0b")], true)
        .unwrap_err();
    assert!(matches!(e, Error::NulInText(1)), "{e}");
}
