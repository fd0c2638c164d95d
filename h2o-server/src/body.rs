//! Request bodies: JSON parsed so that every failure is an OpenAI error object naming what is
//! wrong (not UTF-8, malformed, not an object, a field missing or of the wrong type), for the
//! HTTP layer's extractor and the request types of [`crate::openai`] alike.

use serde::de::DeserializeOwned;

use crate::error::ApiError;

/// A request body: its own fields and, for bodies that have them, fields read in a second pass
/// from the same object ([`Body::read_shared`]).
pub trait Body: DeserializeOwned {
    /// Reads the fields several endpoints share from the whole object; nothing by default.
    ///
    /// # Errors
    /// A 400 naming the field at fault.
    fn read_shared(&mut self, _value: serde_json::Value) -> Result<(), ApiError> {
        Ok(())
    }
}

/// Parses a request body: UTF-8, then JSON syntax, then the endpoint's fields and the common
/// ones, each failure a 400 that says which.
pub fn parse_json<T: Body>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid(
            None,
            "the request body is empty: send a JSON object",
        ));
    }
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(ApiError::invalid(
            None,
            format!(
                "the request body is not UTF-8 text (invalid byte at offset {}): send JSON encoded as UTF-8",
                e.valid_up_to()
            ),
        ));
    }
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| json_error(".", e))?;
    if !value.is_object() {
        return Err(ApiError::invalid(
            None,
            "the request body must be a JSON object ({…})",
        ));
    }
    from_object(value)
}

/// A body from a JSON object already parsed: its own fields, then the shared ones.
pub fn from_object<T: Body>(value: serde_json::Value) -> Result<T, ApiError> {
    let mut body: T = fields(value.clone())?;
    body.read_shared(value)?;
    Ok(body)
}

/// A struct from a JSON object, naming the field at fault.
pub(crate) fn fields<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        json_error(&path, e.into_inner())
    })
}

fn json_error(path: &str, e: serde_json::Error) -> ApiError {
    use serde_json::error::Category;
    match e.classify() {
        Category::Syntax | Category::Eof | Category::Io => {
            ApiError::invalid(None, format!("the request body is not valid JSON: {e}"))
        }
        Category::Data => {
            let msg = e.to_string();
            // serde reports a missing field at the object holding it: name the field itself
            let missing = msg
                .strip_prefix("missing field `")
                .and_then(|rest| rest.split('`').next())
                .map(|field| {
                    if path == "." {
                        field.to_string()
                    } else {
                        format!("{path}.{field}")
                    }
                });
            match missing {
                Some(param) => ApiError::field(&param, format!("missing field `{param}`")),
                None if path == "." => {
                    ApiError::invalid(None, format!("the request body does not fit: {msg}"))
                }
                None => ApiError::field(path, format!("{path}: {msg}")),
            }
        }
    }
}
