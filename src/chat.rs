//! Chat prompts: a conversation rendered with the model's own chat template, through
//! `llama_chat_apply_template`, as llama-server renders `/v1/chat/completions` requests.
//!
//! llama.cpp recognises its built-in templates (ChatML, Llama 3, Gemma, …) from the template
//! text stored in the GGUF; it does not run arbitrary Jinja. A model without a template, or with
//! one llama.cpp does not recognise, is an error naming the model, never a silently made-up
//! format.

use std::ffi::{CStr, CString};

use crate::error::{Error, Result};
use crate::model::Model;
use crate::sys;

/// One message of a conversation: `role` is `system`, `user` or `assistant` (as OpenAI's API
/// and the templates name them).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    #[must_use]
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

impl Model {
    /// The model's default chat template (the GGUF's `tokenizer.chat_template`), if it has one.
    #[must_use]
    pub fn chat_template(&self) -> Option<String> {
        // SAFETY: valid model; a NULL name asks for the default template. The returned string
        // is owned by the model and NUL-terminated.
        let p = unsafe { sys::llama_model_chat_template(self.as_ptr(), std::ptr::null()) };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-NULL, NUL-terminated, alive as long as the model.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }

    /// Renders `messages` with the model's chat template; with `add_assistant`, the text ends
    /// where the assistant's reply begins (what a completion request needs).
    ///
    /// # Errors
    /// [`Error::ChatTemplate`] when the model has no chat template, llama.cpp does not recognise
    /// it, or there are no messages; [`Error::NulInText`] for a NUL byte in a role or content.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_assistant: bool,
    ) -> Result<String> {
        self.apply_named_chat_template(None, messages, add_assistant)
    }

    /// As [`Model::apply_chat_template`], with `template` in place of the model's own when
    /// given: the name of one of llama.cpp's built-in templates (`chatml`, `llama3`,
    /// `command-r`, … as llama-server's `--chat-template`) or a template's text.
    ///
    /// # Errors
    /// As [`Model::apply_chat_template`]; a name llama.cpp does not know is
    /// [`Error::ChatTemplate`].
    pub fn apply_named_chat_template(
        &self,
        template: Option<&str>,
        messages: &[ChatMessage],
        add_assistant: bool,
    ) -> Result<String> {
        if messages.is_empty() {
            return Err(Error::ChatTemplate(
                "no messages: a chat prompt needs at least one message".into(),
            ));
        }
        let text = template
            .map(str::to_string)
            .or_else(|| self.chat_template());
        let text = text.ok_or_else(|| {
            Error::ChatTemplate(format!(
                "{} has no chat template in its GGUF: give the prompt as plain text instead",
                self.path().display()
            ))
        })?;
        let c_template = CString::new(text)?;
        let owned: Vec<(CString, CString)> = messages
            .iter()
            .map(|m| {
                Ok((
                    CString::new(m.role.as_str())?,
                    CString::new(m.content.as_str())?,
                ))
            })
            .collect::<Result<_>>()?;
        let raw: Vec<sys::llama_chat_message> = owned
            .iter()
            .map(|(role, content)| sys::llama_chat_message {
                role: role.as_ptr(),
                content: content.as_ptr(),
            })
            .collect();
        let total: usize = messages
            .iter()
            .map(|m| m.role.len() + m.content.len())
            .sum();
        let mut buf = vec![0u8; 2 * total + 256];
        loop {
            let len = i32::try_from(buf.len())
                .map_err(|_| Error::ChatTemplate("the conversation is over 2 GiB".into()))?;
            // SAFETY: the template and every message string are NUL-terminated CStrings alive
            // for the call; buf is writable for `len` bytes.
            let n = unsafe {
                sys::llama_chat_apply_template(
                    c_template.as_ptr(),
                    raw.as_ptr(),
                    raw.len(),
                    add_assistant,
                    buf.as_mut_ptr().cast(),
                    len,
                )
            };
            let Ok(n) = usize::try_from(n) else {
                return Err(Error::ChatTemplate(match template {
                    Some(name) => format!(
                        "llama.cpp does not recognise the chat template {name:?}: name one of its \
                         built-in templates (chatml, llama3, gemma, command-r, …)"
                    ),
                    None => format!(
                        "llama.cpp does not recognise the chat template of {} (it renders only its \
                         built-in templates): give the prompt as plain text instead",
                        self.path().display()
                    ),
                }));
            };
            if n <= buf.len() {
                buf.truncate(n);
                return String::from_utf8(buf).map_err(|e| {
                    Error::ChatTemplate(format!("the rendered prompt is not UTF-8: {e}"))
                });
            }
            // the rendered text is longer than the buffer: render again into one that fits
            buf = vec![0u8; n];
        }
    }
}
