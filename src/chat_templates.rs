//! Jinja chat templates with tool calls, through common/'s chat library (the C entry
//! points), as llama-server renders `/v1/chat/completions` with `--jinja`.
//!
//! [`ChatTemplates::apply`] renders an OpenAI chat request (messages, `tools`, `tool_choice`, …)
//! with the model's template, or one given in its place, and says how to sample the reply: the
//! grammar that keeps a tool call in the template's format (lazy behind its trigger words when
//! calling a tool is optional), extra stop words and tokens to keep as text. The
//! [`ReplyParser`] it returns splits the reply into content, reasoning and tool calls, whole or
//! in pieces while it streams.
//!
//! Requests and messages are JSON in OpenAI's shapes ([`serde_json::Value`]); llama.cpp checks
//! them, and what it refuses is [`Error::InvalidConfig`] with its reason.

use std::ffi::{CStr, CString};
use std::os::raw::c_char;
use std::ptr::NonNull;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::model::{Model, Token};
use crate::sampler::GrammarTriggers;
use crate::sys;

/// A model's chat templates, parsed once (common/'s `common_chat_templates`).
pub struct ChatTemplates {
    ptr: NonNull<sys::common_chat_c_templates>,
    /// The templates read the vocabulary (grammar triggers, preserved tokens) on every apply.
    _model: Arc<Model>,
}

// SAFETY: the templates are immutable once parsed; `apply` only reads them and the model's
// vocabulary (read-only once loaded). Each apply builds its own Jinja context.
unsafe impl Send for ChatTemplates {}
unsafe impl Sync for ChatTemplates {}

impl Drop for ChatTemplates {
    fn drop(&mut self) {
        // SAFETY: owned pointer, freed once.
        unsafe { sys::common_chat_c_templates_free(self.ptr.as_ptr()) }
    }
}

impl std::fmt::Debug for ChatTemplates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplates").finish_non_exhaustive()
    }
}

/// A rendered chat request: the prompt and how to sample its reply.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ChatPrompt {
    /// The conversation in the template, the assistant's turn opened.
    pub prompt: String,
    /// The reply parser's format (common/'s name for it, e.g. `peg-native`).
    pub format: String,
    /// GBNF the reply must follow (empty: none): a tool call's format, or the request's
    /// `json_schema`/`grammar`.
    pub grammar: String,
    /// The grammar binds only after one of its triggers.
    pub grammar_lazy: bool,
    grammar_trigger_patterns: Vec<String>,
    grammar_trigger_tokens: Vec<Token>,
    /// The generation prompt's tokens, which the grammar takes before the reply's first.
    pub grammar_prefill_tokens: Vec<Token>,
    /// Tokens (special ones) that the template's format uses and the reply keeps as text.
    pub preserved_tokens: Vec<Token>,
    /// Stop words beyond the request's.
    pub additional_stops: Vec<String>,
}

impl ChatPrompt {
    /// The grammar's triggers when it is lazy.
    #[must_use]
    pub fn grammar_triggers(&self) -> Option<GrammarTriggers> {
        self.grammar_lazy.then(|| GrammarTriggers {
            patterns: self.grammar_trigger_patterns.clone(),
            tokens: self.grammar_trigger_tokens.clone(),
        })
    }
}

/// A chat template's Jinja text and capabilities ([`ChatTemplates::info`]).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ChatTemplateInfo {
    pub source: String,
    pub caps: std::collections::BTreeMap<String, bool>,
}

/// One tool call of a reply, as OpenAI's `tool_calls[i].function` with its `id`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (possibly cut short while the reply streams).
    pub arguments: String,
    pub id: String,
}

/// A reply split by the template's format.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct ChatReply {
    pub content: String,
    /// Thinking, for templates that mark it (`<think>…</think>`).
    pub reasoning_content: String,
    pub tool_calls: Vec<ToolCall>,
}

/// What a reply gained since the previous [`ReplyParser::update`] (common/'s
/// `common_chat_msg_diff`): text, reasoning, or a piece of tool call `tool_call_index`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ReplyDelta {
    #[serde(rename = "content_delta")]
    pub content: String,
    #[serde(rename = "reasoning_content_delta")]
    pub reasoning_content: String,
    /// The tool call this piece belongs to; its name and id come with its first piece.
    #[serde(default)]
    pub tool_call_index: Option<usize>,
    #[serde(default)]
    pub tool_call: Option<ToolCall>,
}

/// The parser of one reply, made by [`ChatTemplates::apply`] for the template it rendered.
pub struct ReplyParser {
    ptr: NonNull<sys::common_chat_c_parser>,
}

// SAFETY: the parser is only used through &mut self.
unsafe impl Send for ReplyParser {}

impl Drop for ReplyParser {
    fn drop(&mut self) {
        // SAFETY: owned pointer, freed once.
        unsafe { sys::common_chat_c_parser_free(self.ptr.as_ptr()) }
    }
}

impl std::fmt::Debug for ReplyParser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplyParser").finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct Update {
    message: ChatReply,
    diffs: Vec<ReplyDelta>,
}

/// Takes a string common/'s C entry points returned (malloc'd, or NULL with `error` set).
///
/// # Safety
/// `text` and `error` come from one call of a `common_chat_c_*` function.
unsafe fn take(text: *mut c_char, error: *mut c_char, what: &str) -> Result<String> {
    let own = |p: *mut c_char| {
        // SAFETY: a NUL-terminated string from the C entry points, freed once here.
        unsafe {
            let s = CStr::from_ptr(p).to_string_lossy().into_owned();
            sys::common_chat_c_free(p);
            s
        }
    };
    if text.is_null() {
        let reason = if error.is_null() {
            "out of memory".to_string()
        } else {
            own(error)
        };
        return Err(Error::InvalidConfig(format!("{what}: {}", reason.trim())));
    }
    Ok(own(text))
}

fn c_string(text: &str, what: &str) -> Result<CString> {
    CString::new(text).map_err(|_| Error::InvalidConfig(format!("{what} contains a NUL byte")))
}

fn from_json<T: for<'de> Deserialize<'de>>(text: &str) -> Result<T> {
    serde_json::from_str(text).map_err(|e| {
        Error::InvalidConfig(format!(
            "common/'s chat library answered in an unexpected shape: {e}"
        ))
    })
}

impl ChatTemplates {
    /// The model's chat templates, or `template` (Jinja source) in their place.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`]: the template does not parse, or the model has none and none is
    /// given.
    pub fn new(model: Arc<Model>, template: Option<&str>) -> Result<Self> {
        let template = template
            .map(|t| c_string(t, "the chat template"))
            .transpose()?;
        if template.is_none() && model.chat_template().is_none() {
            return Err(Error::InvalidConfig(
                "the model has no chat template: give one (Jinja source)".into(),
            ));
        }
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: a live model and a NUL-terminated template or NULL; the entry point catches
        // every C++ exception.
        let ptr = unsafe {
            sys::common_chat_c_templates_init(
                model.as_ptr(),
                template.as_ref().map_or(std::ptr::null(), |t| t.as_ptr()),
                &raw mut error,
            )
        };
        let Some(ptr) = NonNull::new(ptr) else {
            // SAFETY: the init call's error string.
            let e = unsafe {
                take(
                    std::ptr::null_mut(),
                    error,
                    "the chat template cannot be used",
                )
            };
            return Err(e.expect_err("a NULL result is an error"));
        };
        Ok(Self { ptr, _model: model })
    }

    /// The default template's Jinja text and what it supports (`supports_tools`,
    /// `supports_tool_calls`, `supports_system_role`, …), as llama-server's `/props` reports them.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when common/'s chat library cannot say.
    pub fn info(&self) -> Result<ChatTemplateInfo> {
        // SAFETY: live templates; the entry point catches every C++ exception (NULL then).
        let text = unsafe {
            let result = sys::common_chat_c_templates_info(self.ptr.as_ptr());
            take(
                result,
                std::ptr::null_mut(),
                "the chat template's capabilities",
            )?
        };
        from_json(&text)
    }

    /// Renders `request`, an object with llama-server's chat fields: `messages` (OpenAI's
    /// shapes, tool calls and tool results included), `tools`, `tool_choice` (`auto`,
    /// `required`, `none`), `parallel_tool_calls`, `add_generation_prompt`, `json_schema`,
    /// `grammar`, `chat_template_kwargs`, `enable_thinking`, `reasoning_format`.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] with llama.cpp's reason: a malformed message or tool, a
    /// `tool_choice` it does not know, a grammar beside tools, or tools on a template whose
    /// tool call format it cannot work out.
    pub fn apply(&self, request: &Value) -> Result<(ChatPrompt, ReplyParser)> {
        let request = c_string(&request.to_string(), "the chat request")?;
        let mut parser: *mut sys::common_chat_c_parser = std::ptr::null_mut();
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: live templates, a NUL-terminated request and out pointers; the entry point
        // catches every C++ exception and sets `parser` only on success.
        let text = unsafe {
            let result = sys::common_chat_c_apply(
                self.ptr.as_ptr(),
                request.as_ptr(),
                &raw mut parser,
                &raw mut error,
            );
            take(
                result,
                error,
                "the chat template cannot render this request",
            )
        };
        let parser = NonNull::new(parser).map(|ptr| ReplyParser { ptr });
        let text = text?;
        let parser = parser.ok_or_else(|| {
            Error::InvalidConfig("common/'s chat library returned no reply parser".into())
        })?;
        Ok((from_json(&text)?, parser))
    }
}

impl ReplyParser {
    /// Parses the reply so far (`text` is all of it, not the new part; `partial` while more
    /// may come) and returns the reply with what changed since the previous update. Tool calls
    /// get llama-server's random ids, kept from one update to the next.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`]: a finished reply (`!partial`) that does not match the
    /// template's format.
    pub fn update(&mut self, text: &str, partial: bool) -> Result<(ChatReply, Vec<ReplyDelta>)> {
        let text = c_string(text, "the reply")?;
        let mut error: *mut c_char = std::ptr::null_mut();
        // SAFETY: a live parser and a NUL-terminated text; the entry point catches every C++
        // exception.
        let out = unsafe {
            let result = sys::common_chat_c_parser_update(
                self.ptr.as_ptr(),
                text.as_ptr(),
                partial,
                &raw mut error,
            );
            take(result, error, "the reply does not parse")?
        };
        let u: Update = from_json(&out)?;
        Ok((u.message, u.diffs))
    }
}
