//! llama-server's `POST /infill`: `/completion`'s fields (sampling, `n_predict`, `stream`, ...)
//! and the code around the cursor, checked as llama-server checks them.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::{check_nul, LlamaCompletionRequest};
use crate::body::Body;
use crate::engine::{EngineInfo, Infill, InfillChunk, Job, Prompt};
use crate::error::ApiError;

/// The body of `/infill`: its own fields, the rest read as a `/completion` request's.
#[derive(Debug, Deserialize)]
pub struct InfillRequest {
    #[serde(default)]
    pub input_prefix: Value,
    #[serde(default)]
    pub input_suffix: Value,
    /// Other files of the project: `[{"filename": string, "text": string}, ...]`.
    #[serde(default)]
    pub input_extra: Value,
    /// Text that starts the completion, after the prefix.
    #[serde(default)]
    pub prompt: Value,
    #[serde(flatten)]
    pub rest: Map<String, Value>,
}

impl Body for InfillRequest {}

impl InfillRequest {
    /// The job and how its answer is sent, as `/completion`'s: a 400 naming the first bad
    /// field, a 501 where the model's vocabulary has no fill-in-the-middle tokens.
    pub fn into_job(self, info: &EngineInfo) -> Result<(Job, super::Delivery), ApiError> {
        let fim = &info.fim;
        if fim.prefix.is_none() || fim.suffix.is_none() || fim.middle.is_none() {
            return Err(ApiError::not_supported(
                crate::engine::infill::not_supported(fim),
            ));
        }
        let prefix = text("input_prefix", &self.input_prefix)?;
        let suffix = text("input_suffix", &self.input_suffix)?;
        let prompt = match &self.prompt {
            Value::Null => String::new(),
            Value::String(s) => {
                check_nul("prompt", s)?;
                s.clone()
            }
            _ => return Err(ApiError::field("prompt", "\"prompt\" must be a string")),
        };
        let extra = extra(&self.input_extra)?;
        // the rest as a /completion request of one prompt, which the layout then replaces
        let mut rest = Value::Object(self.rest);
        rest["prompt"] = Value::from("-");
        let request: LlamaCompletionRequest = crate::body::from_object(rest)?;
        let n_predict = request.n_predict.unwrap_or(info.defaults.n_predict);
        let (mut jobs, delivery) = request.into_job(info)?;
        let mut job = jobs.pop().expect("one prompt, one job");
        job.prompt = Prompt::Infill(Infill {
            prefix,
            suffix,
            extra,
            prompt,
            n_predict,
        });
        Ok((job, delivery))
    }
}

/// `input_prefix` or `input_suffix`: a string, empty where left out.
fn text(param: &str, v: &Value) -> Result<String, ApiError> {
    match v {
        Value::Null => Ok(String::new()),
        Value::String(s) => {
            check_nul(param, s)?;
            Ok(s.clone())
        }
        _ => Err(ApiError::field(
            param,
            format!("\"{param}\" must be a string"),
        )),
    }
}

/// `input_extra`, as llama-server checks it (a file without a name is `tmp`).
fn extra(v: &Value) -> Result<Vec<InfillChunk>, ApiError> {
    let chunks = match v {
        Value::Null => return Ok(Vec::new()),
        Value::Array(items) => items,
        _ => {
            return Err(ApiError::field(
                "input_extra",
                "\"input_extra\" must be an array of {\"filename\": string, \"text\": string}",
            ))
        }
    };
    chunks
        .iter()
        .map(|chunk| {
            let Some(text) = chunk.get("text").and_then(Value::as_str) else {
                return Err(ApiError::field(
                    "input_extra",
                    "extra_context chunk must contain a \"text\" field with a string value",
                ));
            };
            let filename = match chunk.get("filename") {
                None => "tmp",
                Some(Value::String(f)) => f.as_str(),
                Some(_) => {
                    return Err(ApiError::field(
                        "input_extra",
                        "extra_context chunk's \"filename\" field must be a string",
                    ))
                }
            };
            check_nul("input_extra", text)?;
            check_nul("input_extra", filename)?;
            Ok(InfillChunk {
                filename: filename.to_string(),
                text: text.to_string(),
            })
        })
        .collect()
}
