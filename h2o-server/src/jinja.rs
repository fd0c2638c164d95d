//! Chat requests rendered by common/'s Jinja templates (the library's [`ChatTemplates`]), as
//! llama-server renders them: `tools` and `tool_choice` go into the prompt, the reply is
//! sampled under the template's tool call grammar, and its [`ReplyParser`] turns the reply
//! into content and `tool_calls`.
//!
//! Which requests take this path: with `--jinja`, every chat request; by default, those that
//! declare tools (the others keep llama.cpp's built-in templates); with `--no-jinja`, none, and
//! tools are refused.

use h2o_llama::{ChatMessage, ChatPrompt, ReplyParser};
use serde_json::{json, Map, Value};

use crate::engine::{JobError, Sampling};
use crate::error::{library_reason, ApiError};

pub use crate::engine::{Jinja, JinjaMode};

/// The chat fields a Jinja render reads (the rest of the request is the job's).
pub struct ChatFields<'a> {
    pub messages: &'a Value,
    pub tools: &'a Value,
    pub tool_choice: &'a Value,
    pub parallel_tool_calls: Option<bool>,
    pub chat_template_kwargs: &'a Value,
    pub reasoning_format: Option<&'a str>,
}

/// A rendered request: its prompt, how to sample the reply, and the reply's parser.
pub struct Rendered {
    pub prompt: String,
    pub chat: ChatPrompt,
    pub parser: ReplyParser,
}

impl Jinja {
    /// Whether a chat request (with tools or not) goes through the Jinja templates.
    ///
    /// # Errors
    /// Tools under `--no-jinja`.
    pub fn renders(&self, has_tools: bool) -> Result<bool, ApiError> {
        match (self.mode, has_tools) {
            (JinjaMode::Off, true) => Err(ApiError::field(
                "tools",
                "tools need the Jinja chat templates, which --no-jinja turned off: start the \
                 server without --no-jinja",
            )),
            (JinjaMode::Off, false) | (JinjaMode::Tools, false) => Ok(false),
            (JinjaMode::Tools, true) | (JinjaMode::All, _) => Ok(true),
        }
    }

    /// Renders a chat request. A last assistant message is a prefill, as in llama-server: the
    /// prompt opens the assistant's turn and ends with its text.
    ///
    /// # Errors
    /// A 400 with llama.cpp's reason for a request it refuses (a malformed message or tool, an
    /// unknown `tool_choice`, tools on a template whose tool call format it cannot work out).
    pub fn render(&self, fields: &ChatFields<'_>) -> Result<Rendered, ApiError> {
        let has_tools = is_given(fields.tools);
        let param = if has_tools { "tools" } else { "messages" };
        let templates = self.templates.as_ref().map_err(|e| {
            ApiError::field(
                param,
                format!("the chat template cannot be rendered with Jinja: {e}"),
            )
        })?;
        let mut messages = fields
            .messages
            .as_array()
            .cloned()
            .ok_or_else(|| ApiError::field("messages", "messages must be an array"))?;
        let prefill = match messages.last() {
            Some(last)
                if messages.len() > 1
                    && last.get("role").and_then(Value::as_str) == Some("assistant")
                    && !is_given(last.get("tool_calls").unwrap_or(&Value::Null)) =>
            {
                // a string, or text parts
                let text = match last.get("content") {
                    Some(Value::String(t)) => t.clone(),
                    Some(Value::Array(parts)) => parts
                        .iter()
                        .filter_map(|p| p.get("text").and_then(Value::as_str))
                        .collect(),
                    _ => String::new(),
                };
                messages.pop();
                text
            }
            _ => String::new(),
        };
        let mut request = Map::new();
        request.insert("messages".into(), Value::Array(messages));
        let mut tools = fields.tools.clone();
        match fields.tool_choice {
            Value::Null => {}
            Value::String(s) => {
                request.insert("tool_choice".into(), json!(s));
            }
            // OpenAI's form naming one function: that tool alone, and a call required
            choice => {
                let name = named_function(choice)?;
                let named =
                    |t: &&Value| t.pointer("/function/name").and_then(Value::as_str) == Some(name);
                let one: Vec<Value> = tools
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(named)
                    .cloned()
                    .collect();
                if one.is_empty() {
                    return Err(ApiError::field(
                        "tool_choice",
                        format!("tool_choice names {name:?}, which is not one of the tools"),
                    ));
                }
                tools = Value::Array(one);
                request.insert("tool_choice".into(), json!("required"));
            }
        }
        if has_tools {
            request.insert("tools".into(), tools);
        }
        if let Some(p) = fields.parallel_tool_calls {
            request.insert("parallel_tool_calls".into(), json!(p));
        }
        if is_given(fields.chat_template_kwargs) {
            request.insert(
                "chat_template_kwargs".into(),
                fields.chat_template_kwargs.clone(),
            );
        }
        if let Some(f) = fields.reasoning_format.or(self.reasoning_format.as_deref()) {
            request.insert("reasoning_format".into(), json!(f));
        }
        let (chat, parser) = templates.apply(&Value::Object(request)).map_err(|e| {
            let mut message = library_reason(e);
            if message.contains("does not support tool calls") {
                message.push_str(
                    ": start the server with --chat-template-file naming a template that has \
                     them (examples/templates/chatml-tools.jinja for ChatML models)",
                );
            }
            ApiError::field(param, message)
        })?;
        Ok(Rendered {
            prompt: chat.prompt.clone() + &prefill,
            chat,
            parser,
        })
    }
}

impl Rendered {
    /// The sampling a reply in the template's format needs: its grammar (lazy behind its
    /// triggers when a tool call is optional), stop words and preserved tokens.
    ///
    /// # Errors
    /// A request grammar (`grammar`, `json_schema`, `response_format`) beside a tool call
    /// grammar: llama.cpp cannot follow two.
    pub fn configure(&self, sampling: &mut Sampling) -> Result<(), ApiError> {
        let chat = &self.chat;
        if !chat.grammar.is_empty() {
            if let Some((_, param)) = &sampling.grammar {
                return Err(ApiError::field(
                    param,
                    format!(
                        "{param} and tools both constrain the answer (tool calls follow the \
                         template's own grammar): send one"
                    ),
                ));
            }
            sampling.grammar = Some((chat.grammar.clone(), "tools"));
            sampling.grammar_triggers = chat.grammar_triggers();
            sampling
                .grammar_prefill
                .clone_from(&chat.grammar_prefill_tokens);
        }
        sampling.preserved_tokens.clone_from(&chat.preserved_tokens);
        for stop in &chat.additional_stops {
            if !sampling.stop.contains(stop) {
                sampling.stop.push(stop.clone());
            }
        }
        Ok(())
    }
}

/// `POST /apply-template` under `--jinja`: `messages` rendered by the Jinja template with the
/// assistant's turn opened; `None` in the other modes, which render it with llama.cpp's
/// built-in template.
pub fn apply_template(jinja: &Jinja, messages: &[ChatMessage]) -> Option<Result<String, JobError>> {
    if jinja.mode != JinjaMode::All {
        return None;
    }
    let messages = match serde_json::to_value(messages) {
        Ok(m) => m,
        Err(e) => return Some(Err(JobError::Template(e.to_string()))),
    };
    let fields = ChatFields {
        messages: &messages,
        tools: &Value::Null,
        tool_choice: &Value::Null,
        parallel_tool_calls: None,
        chat_template_kwargs: &Value::Null,
        reasoning_format: None,
    };
    Some(
        jinja
            .render(&fields)
            .map(|r| r.prompt)
            .map_err(|e| JobError::Template(e.message)),
    )
}

/// The function `{"type": "function", "function": {"name": …}}` names.
fn named_function(choice: &Value) -> Result<&str, ApiError> {
    match (
        choice.get("type").and_then(Value::as_str),
        choice.pointer("/function/name").and_then(Value::as_str),
    ) {
        (Some("function"), Some(name)) => Ok(name),
        _ => Err(ApiError::field(
            "tool_choice",
            "tool_choice must be \"auto\", \"required\", \"none\" or {\"type\": \"function\", \
             \"function\": {\"name\": …}}",
        )),
    }
}

/// A field that is present and not empty.
pub fn is_given(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        _ => true,
    }
}
