//! The sampling fields of a generation request, each checked against its range and the
//! server (`max_tokens`, `temperature`, `logit_bias`, `stop`, `grammar`, `response_format`, the
//! H2O fields), turned into the job's [`Sampling`] and [`H2oOverrides`].

use h2o_llama::Selection;
use serde_json::Value;

use super::prompt::check_nul;
use super::{json_kind, random_u64, Common};
use crate::engine::{EngineInfo, H2oOverrides, Sampling};
use crate::error::{library_reason, ApiError};

/// OpenAI's range for `temperature`.
const MAX_TEMPERATURE: f64 = 2.0;

/// A count field in 0..=`max`.
pub(super) fn count_field(param: &str, n: i64, max: usize) -> Result<usize, ApiError> {
    usize::try_from(n)
        .ok()
        .filter(|&n| n <= max)
        .ok_or_else(|| {
            ApiError::field(
                param,
                format!("{param} must be between 0 and {max}, got {n}"),
            )
        })
}

/// The grammar `response_format` asks for: none for `text`, any JSON object for `json_object`
/// without a schema, and the schema's grammar (llama.cpp's converter) with one.
pub(super) fn response_format_grammar(
    v: &Value,
) -> Result<Option<(String, &'static str)>, ApiError> {
    const PARAM: &str = "response_format";
    if v.is_null() {
        return Ok(None);
    }
    let kind = v.get("type").and_then(Value::as_str).ok_or_else(|| {
        ApiError::field(
            PARAM,
            "response_format must be an object with a type: text, json_object or json_schema",
        )
    })?;
    let schema = match kind {
        "text" => return Ok(None),
        "json_object" => v.get("schema"),
        "json_schema" => v.get("json_schema").and_then(|j| j.get("schema")),
        other => {
            return Err(ApiError::field(
                PARAM,
                format!(
                    "response_format type {other:?} is not one of text, json_object, json_schema"
                ),
            ))
        }
    };
    match schema {
        None => Ok(Some((h2o_llama::grammars::JSON_OBJECT.to_string(), PARAM))),
        Some(schema) => schema_grammar(schema, PARAM).map(Some),
    }
}

/// A JSON schema's grammar, by llama.cpp's converter; a schema it cannot convert is a 400
/// with its reason.
fn schema_grammar(schema: &Value, param: &'static str) -> Result<(String, &'static str), ApiError> {
    if !schema.is_object() {
        return Err(ApiError::field(
            param,
            format!(
                "{param}: a JSON schema is an object, not {}",
                json_kind(schema)
            ),
        ));
    }
    h2o_llama::grammars::from_json_schema(&schema.to_string())
        .map(|g| (g, param))
        .map_err(|e| ApiError::field(param, format!("{param}: {}", library_reason(e))))
}

/// The most tokens to generate: at least 1, at most a slot's context. Absent means until the end
/// of generation or a full slot (OpenAI's and llama-server's default); `/completion` also takes
/// llama-server's -1 for that.
pub(super) fn max_tokens(
    param: &str,
    v: Option<i64>,
    minus_one_unlimited: bool,
    info: &EngineInfo,
) -> Result<u32, ApiError> {
    let limit = info.n_ctx_slot;
    match v {
        None => Ok(limit),
        Some(-1) if minus_one_unlimited => Ok(limit),
        Some(n) if n < 1 => Err(ApiError::field(
            param,
            format!(
                "{param} must be at least 1{}, got {n}",
                if minus_one_unlimited { " (or -1: until the slot is full)" } else { "" }
            ),
        )),
        Some(n) if n > i64::from(limit) => Err(ApiError::field(
            param,
            format!(
                "{param} = {n} is more than a slot's context of {limit} tokens (prompt and completion \
                 together): ask for at most {limit}, or start the server with a larger -c"
            ),
        )),
        Some(n) => Ok(n as u32),
    }
}

pub(super) fn sampling(
    c: &Common,
    max_tokens: u32,
    info: &EngineInfo,
) -> Result<Sampling, ApiError> {
    let defaults = &info.defaults;
    let temperature = c.temperature.unwrap_or(defaults.temperature);
    if !(0.0..=MAX_TEMPERATURE).contains(&temperature) {
        return Err(ApiError::field(
            "temperature",
            format!("temperature must be between 0 and {MAX_TEMPERATURE} (0 = greedy), got {temperature}"),
        ));
    }
    let top_p = c.top_p.unwrap_or(defaults.top_p);
    if !(0.0..=1.0).contains(&top_p) {
        return Err(ApiError::field(
            "top_p",
            format!("top_p must be between 0 and 1, got {top_p}"),
        ));
    }
    let top_k = match c.top_k {
        None => defaults.top_k,
        Some(k) => i32::try_from(k).ok().filter(|&k| k >= 0).ok_or_else(|| {
            ApiError::field(
                "top_k",
                format!("top_k must be at least 0 (0: off), got {k}"),
            )
        })?,
    };
    let seed = match c.seed.or(Some(defaults.seed)) {
        None | Some(-1) => random_u64() as u32,
        Some(s) => u32::try_from(s).map_err(|_| {
            ApiError::field(
                "seed",
                format!(
                    "seed must be between 0 and {} (or -1: random), got {s}",
                    u32::MAX
                ),
            )
        })?,
    };
    let bias = logit_bias(&c.logit_bias, info)?;
    let grammar = match (&c.grammar, c.json_schema.is_null()) {
        (Some(_), false) => {
            return Err(ApiError::field(
                "json_schema",
                "grammar and json_schema both constrain the answer: send one",
            ))
        }
        (Some(g), true) => {
            check_nul("grammar", g)?;
            Some((g.clone(), "grammar"))
        }
        (None, false) => Some(schema_grammar(&c.json_schema, "json_schema")?),
        (None, true) => None,
    };
    Ok(Sampling {
        max_tokens,
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        seed,
        stop: stop_strings(&c.stop)?,
        logit_bias: bias.0,
        logit_bias_text: bias.1,
        grammar,
        grammar_triggers: None,
        grammar_prefill: Vec::new(),
        preserved_tokens: Vec::new(),
        probs: None,
        post_sampling_probs: false,
    })
}

/// Biases by token id, and by text (each token of the text).
type Biases = (Vec<(h2o_llama::Token, f32)>, Vec<(String, f32)>);

/// `logit_bias`: OpenAI's `{"TOKEN_ID" or "text": bias}`, or llama-server's `[[TOKEN_ID or
/// "text", bias], …]`, where a bias of `false` bans the token and a text biases each of its tokens. Ids
/// outside the vocabulary are refused (a typo would otherwise bias nothing, silently).
fn logit_bias(v: &Value, info: &EngineInfo) -> Result<Biases, ApiError> {
    const PARAM: &str = "logit_bias";
    let token = |key: &str, raw: &Value| -> Result<h2o_llama::Token, ApiError> {
        raw.as_i64()
            .or_else(|| raw.as_str().and_then(|s| s.trim().parse().ok()))
            .and_then(|t| h2o_llama::Token::try_from(t).ok())
            .filter(|&t| usize::try_from(t).is_ok_and(|t| t < info.n_vocab))
            .ok_or_else(|| {
                ApiError::field(
                    PARAM,
                    format!(
                        "logit_bias{key} names token {raw}, which is not in this model's \
                         vocabulary (ids 0..{}): use /tokenize to find a text's ids",
                        info.n_vocab
                    ),
                )
            })
    };
    let bias = |key: &str, raw: &Value| -> Result<f32, ApiError> {
        match raw {
            Value::Bool(false) => Ok(f32::NEG_INFINITY),
            Value::Number(n) if n.as_f64().is_some_and(f64::is_finite) => {
                Ok(n.as_f64().unwrap_or_default() as f32)
            }
            other => Err(ApiError::field(
                PARAM,
                format!("logit_bias{key} must be a number or false, not {other}"),
            )),
        }
    };
    let mut by_id = Vec::new();
    let mut by_text = Vec::new();
    match v {
        Value::Null => {}
        Value::Object(map) => {
            for (k, b) in map {
                let key = format!("[{k:?}]");
                // a key that is a number is a token id; any other, a text (llama-server's)
                if k.trim().parse::<i64>().is_ok() {
                    by_id.push((token(&key, &Value::String(k.clone()))?, bias(&key, b)?));
                } else {
                    check_nul(PARAM, k)?;
                    by_text.push((k.clone(), bias(&key, b)?));
                }
            }
        }
        Value::Array(pairs) => {
            for (i, pair) in pairs.iter().enumerate() {
                let key = format!("[{i}]");
                match pair.as_array().map(Vec::as_slice) {
                    Some([Value::String(text), b]) => {
                        check_nul(PARAM, text)?;
                        by_text.push((text.clone(), bias(&key, b)?));
                    }
                    Some([t, b]) => by_id.push((token(&key, t)?, bias(&key, b)?)),
                    _ => {
                        return Err(ApiError::field(
                            PARAM,
                            format!("logit_bias[{i}] must be a pair [token_id or text, bias]"),
                        ))
                    }
                }
            }
        }
        other => Err(ApiError::field(
            PARAM,
            format!(
                "logit_bias must be an object {{\"token_id\": bias}} or an array of pairs, not {}",
                json_kind(other)
            ),
        ))?,
    }
    Ok((by_id, by_text))
}

fn stop_strings(v: &Value) -> Result<Vec<String>, ApiError> {
    let list: Vec<&Value> = match v {
        Value::Null => return Ok(Vec::new()),
        Value::String(_) => vec![v],
        Value::Array(items) => items.iter().collect(),
        other => {
            return Err(ApiError::field(
                "stop",
                format!(
                    "stop must be a string or an array of strings, not {}",
                    json_kind(other)
                ),
            ))
        }
    };
    list.into_iter()
        .enumerate()
        .map(|(i, s)| match s {
            // an empty stop string would end every answer before it begins
            Value::String(s) if s.is_empty() => {
                Err(ApiError::field("stop", format!("stop[{i}] is empty")))
            }
            Value::String(s) => Ok(s.clone()),
            other => Err(ApiError::field(
                "stop",
                format!("stop[{i}] must be a string, not {}", json_kind(other)),
            )),
        })
        .collect()
}

/// The request's H2O fields, checked against the server's L and H as `--h2o-*` are at start.
pub(super) fn h2o_overrides(c: &Common, info: &EngineInfo) -> Result<H2oOverrides, ApiError> {
    let decode_budget = h2o_decode_budget(c, info)?;
    if c.h2o_select.is_none() && c.h2o_sink.is_none() && c.h2o_dense_tail.is_none() {
        return Ok(H2oOverrides {
            decode_budget,
            ..H2oOverrides::default()
        });
    }
    let Some(h2o) = info.h2o.filter(h2o_llama::H2oConfig::is_enabled) else {
        // silently ignoring them would report full-attention answers as the policy asked for
        let param = if c.h2o_select.is_some() {
            "h2o_select"
        } else if c.h2o_sink.is_some() {
            "h2o_sink"
        } else {
            "h2o_dense_tail"
        };
        return Err(ApiError::field(
            param,
            format!(
                "{param} needs H2O, but this server runs full attention: start it with \
                 --h2o-local L --h2o-heavy H, or leave {param} out"
            ),
        ));
    };
    let select = c
        .h2o_select
        .as_deref()
        .map(|s| {
            s.parse::<Selection>()
                .map_err(|e| ApiError::field("h2o_select", library_reason(e)))
        })
        .transpose()?;
    let sink = c
        .h2o_sink
        .map(|s| match u32::try_from(s) {
            Ok(s) if s <= h2o.heavy => Ok(s),
            _ => Err(ApiError::field(
                "h2o_sink",
                format!(
                    "h2o_sink must be between 0 and the server's heavy budget --h2o-heavy {} (the sink \
                     positions come out of it), got {s}",
                    h2o.heavy
                ),
            )),
        })
        .transpose()?;
    let dense_tail = c
        .h2o_dense_tail
        .map(|t| match u32::try_from(t) {
            Ok(t) if t <= info.n_ctx_slot => Ok(t),
            _ => Err(ApiError::field(
                "h2o_dense_tail",
                format!(
                    "h2o_dense_tail must be between 0 and a slot's context of {} tokens, got {t}",
                    info.n_ctx_slot
                ),
            )),
        })
        .transpose()?;
    Ok(H2oOverrides {
        select,
        sink,
        dense_tail,
        decode_budget,
    })
}

/// The request's decode (`h2o_decode`: `"full"` or `"sparse"`, and `h2o_decode_budget`, which
/// alone means sparse): `Some(0)` for full-attention decode, `Some(budget)` for sparse decode.
/// Full decode is always served; sparse decode needs a server started with it, since only then
/// does its cache keep the key sketches.
fn h2o_decode_budget(c: &Common, info: &EngineInfo) -> Result<Option<u32>, ApiError> {
    let sparse = match c.h2o_decode.as_deref() {
        None => c.h2o_decode_budget.is_some(),
        Some("sparse") => true,
        Some("full") if c.h2o_decode_budget.is_some() => {
            return Err(ApiError::field(
                "h2o_decode_budget",
                "h2o_decode_budget is the budget of sparse decode: leave it out with \"h2o_decode\": \
                 \"full\", or ask for \"sparse\""
                    .to_string(),
            ));
        }
        Some("full") => return Ok(Some(0)),
        Some(other) => {
            return Err(ApiError::field(
                "h2o_decode",
                format!("h2o_decode must be \"full\" or \"sparse\", got \"{other}\""),
            ));
        }
    };
    if !sparse {
        return Ok(None);
    }
    let server = info
        .h2o
        .filter(h2o_llama::H2oConfig::is_enabled)
        .map_or(0, |h| h.decode_budget);
    let param = if c.h2o_decode.is_some() {
        "h2o_decode"
    } else {
        "h2o_decode_budget"
    };
    if server == 0 {
        // decoding the request with full attention would report a sparse answer that is not one
        return Err(ApiError::field(
            param,
            format!(
                "sparse decode needs a server started with it (--h2o-local L --h2o-heavy H \
                 --h2o-decode sparse), which keeps the key sketches; this one decodes with full \
                 attention: leave {param} out"
            ),
        ));
    }
    let Some(budget) = c.h2o_decode_budget else {
        return Ok(Some(server));
    };
    match u32::try_from(budget) {
        Ok(b) if (h2o_llama::H2oConfig::DECODE_BLOCK..=info.n_ctx_slot).contains(&b) => Ok(Some(b)),
        _ => Err(ApiError::field(
            "h2o_decode_budget",
            format!(
                "h2o_decode_budget must be between {} and a slot's context of {} tokens, got {budget}",
                h2o_llama::H2oConfig::DECODE_BLOCK,
                info.n_ctx_slot
            ),
        )),
    }
}
