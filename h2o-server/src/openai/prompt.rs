//! The prompts of a generation request: a chat's messages for llama.cpp's built-in templates,
//! and the completion endpoints' text, token ids and arrays of them.

use h2o_llama::ChatMessage;
use serde_json::Value;

use super::{json_kind, ChatMessageIn};
use crate::engine::{EngineInfo, Prompt, PromptPiece};
use crate::error::ApiError;

/// The checks of [`chat_messages`] that hold for the Jinja templates too: at least one message,
/// and at most one assistant message at the end.
pub(super) fn check_messages(messages: &Value) -> Result<(), ApiError> {
    let Some(list) = messages.as_array() else {
        return Err(ApiError::field(
            "messages",
            format!("messages must be an array, not {}", json_kind(messages)),
        ));
    };
    if list.is_empty() {
        return Err(ApiError::field(
            "messages",
            "messages is empty: send at least one message",
        ));
    }
    let role = |m: &Value| m.get("role").and_then(Value::as_str).map(str::to_string);
    if let [.., a, b] = list.as_slice() {
        if role(a).as_deref() == Some("assistant") && role(b).as_deref() == Some("assistant") {
            return Err(two_assistants());
        }
    }
    Ok(())
}

fn two_assistants() -> ApiError {
    ApiError::field(
        "messages",
        "the last two messages are both from the assistant: a final assistant message is a \
         prefill the reply continues, so only one may end the conversation",
    )
}

/// A conversation's messages, checked: at least one, each with a known role and text content,
/// and at most one assistant message at the end (a prefill the reply continues).
///
/// # Errors
/// A 400 naming the first bad message.
pub fn chat_messages(messages: Vec<ChatMessageIn>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::field(
            "messages",
            "messages is empty: send at least one message",
        ));
    }
    let messages = messages
        .into_iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect::<Result<Vec<_>, _>>()?;
    if let [.., a, b] = messages.as_slice() {
        if a.role == "assistant" && b.role == "assistant" {
            return Err(two_assistants());
        }
    }
    Ok(messages)
}

/// One chat message, with `developer` read as `system` (OpenAI's newer name for it).
fn message(i: usize, m: ChatMessageIn) -> Result<ChatMessage, ApiError> {
    let role = match m.role.as_str() {
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        other => {
            return Err(ApiError::field(
                &format!("messages[{i}].role"),
                format!(
                    "messages[{i}].role {other:?} is not supported: use system, user or assistant"
                ),
            ))
        }
    };
    let param = format!("messages[{i}].content");
    let content = match m.content {
        Value::String(s) => s,
        Value::Null => String::new(),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                match (
                    part.get("type").and_then(Value::as_str),
                    part.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(ApiError::field(
                            &format!("{param}[{j}]"),
                            format!(
                                "{param}[{j}] is {}: this server reads only text parts \
                                 ({{\"type\": \"text\", \"text\": \"…\"}})",
                                kind.map_or_else(
                                    || "not a text part".to_string(),
                                    |k| format!("of type {k:?}")
                                )
                            ),
                        ))
                    }
                }
            }
            text
        }
        other => {
            return Err(ApiError::field(
                &param,
                format!(
                    "{param} must be a string or an array of text parts, not {}",
                    json_kind(&other)
                ),
            ))
        }
    };
    check_nul(&param, &content)?;
    Ok(ChatMessage::new(role, content))
}

/// The prompts of the completion endpoints, as llama-server reads them: a string; an array of
/// token ids and strings (one prompt, the strings tokenized in place); a JSON prompt object
/// (`{"prompt_string": …}`); or an array of those (one prompt each, answered in order).
pub(super) fn prompts(v: &Value, info: &EngineInfo) -> Result<Vec<Prompt>, ApiError> {
    match v {
        Value::Array(items) if items.is_empty() => Err(ApiError::field(
            "prompt",
            "the prompt is empty: send at least one token of text",
        )),
        Value::Array(items)
            if items.iter().any(|p| p.is_array() || p.is_object())
                || (items.len() > 1 && items.iter().all(Value::is_string)) =>
        {
            items
                .iter()
                .enumerate()
                .map(|(i, p)| one_prompt(p, &format!("prompt[{i}]"), info))
                .collect()
        }
        other => Ok(vec![one_prompt(other, "prompt", info)?]),
    }
}

/// One prompt: a string, or an array of token ids and strings.
fn one_prompt(v: &Value, param: &str, info: &EngineInfo) -> Result<Prompt, ApiError> {
    let empty = || {
        ApiError::field(
            param,
            format!("{param} is empty: send at least one token of text"),
        )
    };
    match v {
        Value::String(s) if s.is_empty() => Err(empty()),
        Value::String(s) => {
            check_nul(param, s)?;
            Ok(Prompt::Text(s.clone()))
        }
        // an array with one string is the string (OpenAI's batch of one)
        Value::Array(items) if items.len() == 1 && items[0].is_string() => {
            one_prompt(&items[0], param, info)
        }
        Value::Array(items) if items.is_empty() => Err(empty()),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(j, item)| match item {
                Value::String(s) => {
                    check_nul(param, s)?;
                    Ok(PromptPiece::Text(s.clone()))
                }
                Value::Number(n) => n
                    .as_i64()
                    .and_then(|t| h2o_llama::Token::try_from(t).ok())
                    .filter(|&t| usize::try_from(t).is_ok_and(|t| t < info.n_vocab))
                    .map(PromptPiece::Token)
                    .ok_or_else(|| {
                        ApiError::field(
                            param,
                            format!(
                                "{param}[{j}] = {n} is not a token of this model's vocabulary \
                                 (0..{})",
                                info.n_vocab
                            ),
                        )
                    }),
                other => Err(ApiError::field(
                    param,
                    format!(
                        "{param}[{j}] must be a token id or a string, not {}",
                        json_kind(other)
                    ),
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Prompt::Tokens),
        Value::Object(fields) => json_prompt(fields, param, info),
        Value::Null => Err(ApiError::field("prompt", "missing field `prompt`")),
        other => Err(ApiError::field(
            param,
            format!(
                "{param} must be a string, an array of token ids and strings, or an object with \
                 `prompt_string`, not {}",
                json_kind(other)
            ),
        )),
    }
}

/// llama-server's JSON prompt object: `prompt_string` (text or token ids, as a prompt) and, for
/// models with a multimodal projector, `multimodal_data`, which this server has none of.
fn json_prompt(
    fields: &serde_json::Map<String, Value>,
    param: &str,
    info: &EngineInfo,
) -> Result<Prompt, ApiError> {
    if fields.contains_key("multimodal_data") {
        return Err(ApiError::field(
            param,
            format!(
                "{param}.multimodal_data: this server has no multimodal projector (h2o-server \
                 serves text models only); send the prompt without media"
            ),
        ));
    }
    if let Some(unknown) = fields.keys().find(|k| *k != "prompt_string") {
        return Err(ApiError::field(
            param,
            format!("{param}.{unknown} is not a field of a JSON prompt: use `prompt_string`"),
        ));
    }
    match fields.get("prompt_string") {
        Some(inner @ (Value::String(_) | Value::Array(_))) => {
            one_prompt(inner, &format!("{param}.prompt_string"), info)
        }
        Some(other) => Err(ApiError::field(
            param,
            format!(
                "{param}.prompt_string must be a string or an array of token ids and strings, \
                 not {}",
                json_kind(other)
            ),
        )),
        None => Err(ApiError::field(
            param,
            format!("{param} is an object without `prompt_string`: put the prompt's text there"),
        )),
    }
}

/// llama.cpp's tokenizer takes C strings: a NUL would cut the text short without a word.
pub fn check_nul(param: &str, text: &str) -> Result<(), ApiError> {
    match text.find('\0') {
        Some(at) => Err(ApiError::field(
            param,
            format!("{param} contains a NUL character at byte {at}, which the tokenizer cannot take: remove it"),
        )),
        None => Ok(()),
    }
}
