//! Fuzzing of what the server reads from outside: request bodies of every endpoint (chat, legacy
//! and llama-server completions, tokenize, detokenize, apply-template, slot actions), stream
//! options, token-array prompts, grammar and JSON-schema fields, through the whole HTTP stack
//! against the scripted engine of `tests.rs`. Each case starts from a valid body, takes one to
//! four mutations (a value swapped for random JSON of any type, a field removed, a known field
//! added with a random value, the bytes flipped or cut) and is posted; the answer must come
//! within 10 s, be JSON (or an event stream), and carry a status a client can act on: 200, or a
//! 4xx/501/503 error object. A panic, a hang or a 500 is a finding.
//!
//! `cargo test` runs 300 cases and replays every case kept in `tests/fuzz-corpus/` (the
//! findings, once fixed); `scripts/fuzz.sh` runs many more (`H2O_FUZZ_CASES`, `H2O_FUZZ_SEED`)
//! and keeps the cases that failed.

use std::time::Duration;

use h2o_llama::fuzzing::{kept_cases, Budget, Rng};
use serde_json::{json, Map, Value};

use super::tests::{serve_with, user};
use super::Options;

const ENDPOINTS: &[&str] = &[
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/completion",
    "/completions",
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/slots/0?action=save",
    "/slots/1?action=restore",
];

/// Every field a request body can name, for mutations that add one.
const FIELDS: &[&str] = &[
    "messages",
    "prompt",
    "content",
    "tokens",
    "n_predict",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stream",
    "stream_options",
    "include_usage",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "seed",
    "stop",
    "grammar",
    "json_schema",
    "response_format",
    "logit_bias",
    "n_probs",
    "logprobs",
    "top_logprobs",
    "post_sampling_probs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "id_slot",
    "cache_prompt",
    "n_keep",
    "echo",
    "add_special",
    "parse_special",
    "with_pieces",
    "return_tokens",
    "return_progress",
    "response_fields",
    "reasoning_format",
    "chat_template_kwargs",
    "filename",
    "role",
    "type",
    "schema",
    "name",
    "h2o_decode_budget",
    "samplers",
];

fn pick<'a, T>(rng: &mut Rng, items: &'a [T]) -> &'a T {
    &items[rng.below(items.len())]
}

/// A valid body for `path`.
fn template(path: &str, rng: &mut Rng) -> Value {
    match path {
        "/v1/chat/completions" | "/chat/completions" | "/apply-template" => json!({
            "messages": user("Tell me about the ledger."), "max_tokens": 3,
            "stream": rng.below(2) == 0,
        }),
        "/v1/completions" | "/completion" | "/completions" => json!({
            "prompt": *pick(rng, &[json!("The ledger"), json!([76, 101, 100]), json!(["a", "b"])]),
            "n_predict": 3, "stream": rng.below(2) == 0,
        }),
        "/tokenize" => json!({"content": "The ledger", "with_pieces": true}),
        "/detokenize" => json!({"tokens": [76, 101, 100]}),
        _ => json!({"filename": "slot.bin"}),
    }
}

fn random_string(rng: &mut Rng) -> String {
    let pieces = [
        "",
        "a",
        "The ledger",
        "\u{0}",
        "\u{fffd}",
        "日本語",
        "\"",
        "\\",
        "{",
        "root ::= \"a\"",
        "root ::= (",
        "<|im_start|>",
        "0",
        "-1",
        "1e400",
        "../x",
        "slot.bin",
        "\n\n",
    ];
    let mut s = String::new();
    for _ in 0..rng.below(4) {
        s.push_str(pieces[rng.below(pieces.len())]);
    }
    if rng.below(8) == 0 {
        s.push_str(&"x".repeat(rng.below(5000)));
    }
    s
}

fn random_value(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(if depth > 3 { 6 } else { 9 }) {
        0 => Value::Null,
        1 => Value::Bool(rng.below(2) == 0),
        2 => json!(*pick(
            rng,
            &[
                0i64,
                1,
                -1,
                2,
                64,
                4096,
                i32::MAX as i64,
                i64::MIN,
                i64::MAX
            ]
        )),
        3 => json!(*pick(
            rng,
            &[0.0, 0.5, -0.5, 1.0, 2.0, 1e308, -1e308, 1e-320]
        )),
        4 | 5 => Value::String(random_string(rng)),
        6 => Value::Array(
            (0..rng.below(5))
                .map(|_| random_value(rng, depth + 1))
                .collect(),
        ),
        7 => json!(user(&random_string(rng))),
        _ => {
            let mut m = Map::new();
            for _ in 0..rng.below(4) {
                m.insert(pick(rng, FIELDS).to_string(), random_value(rng, depth + 1));
            }
            Value::Object(m)
        }
    }
}

/// A random node of `v` (the root, or one inside it) to mutate, as a JSON pointer.
fn random_pointer(v: &Value, rng: &mut Rng) -> String {
    let mut pointer = String::new();
    let mut cur = v;
    while rng.below(3) != 0 {
        match cur {
            Value::Object(m) if !m.is_empty() => {
                let (k, next) = m.iter().nth(rng.below(m.len())).unwrap();
                pointer.push('/');
                pointer.push_str(&k.replace('~', "~0").replace('/', "~1"));
                cur = next;
            }
            Value::Array(a) if !a.is_empty() => {
                let i = rng.below(a.len());
                pointer.push_str(&format!("/{i}"));
                cur = &a[i];
            }
            _ => break,
        }
    }
    pointer
}

fn random_node<'a>(v: &'a mut Value, rng: &mut Rng) -> &'a mut Value {
    let pointer = random_pointer(v, rng);
    v.pointer_mut(&pointer).expect("a pointer into the value")
}

/// One case: the path and the body's bytes.
fn case(seed: u64) -> (&'static str, Vec<u8>) {
    let mut rng = Rng::new(seed);
    let path = *pick(&mut rng, ENDPOINTS);
    let mut body = template(path, &mut rng);
    let mut raw = None;
    for _ in 0..1 + rng.below(4) {
        match rng.below(10) {
            0..=3 => *random_node(&mut body, &mut rng) = random_value(&mut rng, 0),
            4 | 5 => {
                if let Value::Object(m) = random_node(&mut body, &mut rng) {
                    if !m.is_empty() {
                        let k = m.keys().nth(rng.below(m.len())).unwrap().clone();
                        m.remove(&k);
                    }
                }
            }
            6 | 7 => {
                if let Value::Object(m) = &mut body {
                    m.insert(
                        pick(&mut rng, FIELDS).to_string(),
                        random_value(&mut rng, 0),
                    );
                }
            }
            _ => {
                let mut bytes = body.to_string().into_bytes();
                if !bytes.is_empty() {
                    if rng.below(2) == 0 {
                        let at = rng.below(bytes.len());
                        bytes[at] = rng.next_u64() as u8;
                    } else {
                        bytes.truncate(rng.below(bytes.len()));
                    }
                }
                raw = Some(bytes);
            }
        }
    }
    (path, raw.unwrap_or_else(|| body.to_string().into_bytes()))
}

/// Posts one case; returns why its answer is a finding, if it is one.
async fn check(server: &super::tests::TestServer, path: &str, body: Vec<u8>) -> Option<String> {
    // the scripted engine hangs or streams forever on these words, by design
    let text = String::from_utf8_lossy(&body).to_lowercase();
    if text.contains("hang") || text.contains("slow") {
        return None;
    }
    let send = async {
        let r = server.post(path, body.clone()).await;
        let status = r.status().as_u16();
        let event_stream = r
            .headers()
            .get("content-type")
            .is_some_and(|v| v.to_str().unwrap_or("").starts_with("text/event-stream"));
        let bytes = r.bytes().await.map_err(|e| e.to_string())?;
        Ok::<_, String>((status, event_stream, bytes))
    };
    match tokio::time::timeout(Duration::from_secs(10), send).await {
        Err(_) => Some("no answer within 10 s".into()),
        Ok(Err(e)) => Some(format!("the answer broke off: {e}")),
        Ok(Ok((status, event_stream, bytes))) => {
            let ok_status = matches!(status, 200 | 400 | 404 | 405 | 413 | 415 | 501 | 503);
            if !ok_status {
                return Some(format!(
                    "status {status}: {}",
                    String::from_utf8_lossy(&bytes)
                ));
            }
            if !event_stream && serde_json::from_slice::<Value>(&bytes).is_err() {
                return Some(format!(
                    "status {status} with a body that is not JSON: {}",
                    String::from_utf8_lossy(&bytes)
                ));
            }
            if status != 200 && !event_stream {
                let v: Value = serde_json::from_slice(&bytes).unwrap();
                if !v["error"]["message"].is_string() {
                    return Some(format!("status {status} without an error message: {v}"));
                }
            }
            None
        }
    }
}

/// A case as the corpus keeps it: "POST PATH", a newline, the body's bytes.
fn corpus_case(path: &str, body: &[u8]) -> Vec<u8> {
    [format!("POST {path}\n").as_bytes(), body].concat()
}

#[tokio::test]
async fn random_requests_are_answered_or_refused_never_crash_or_hang() {
    let budget = Budget::from_env(300);
    let options = Options {
        // the slot actions get as far as the engine, which refuses them (no such slot)
        slot_save_path: Some(std::env::temp_dir()),
        ..Options::new(None, 1 << 20)
    };
    let server = serve_with(1024, options).await;
    let mut findings = Vec::new();
    for i in 0..budget.cases {
        let (path, body) = case(budget.case_seed(i));
        if let Some(why) = check(&server, path, body.clone()).await {
            findings.push((why, corpus_case(path, &body)));
        }
    }
    // the kept cases: a first line "POST PATH", then the body
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-corpus");
    let kept = kept_cases(&corpus);
    for bytes in &kept {
        let split = bytes
            .iter()
            .position(|&b| b == b'\n')
            .unwrap_or(bytes.len());
        let head = String::from_utf8_lossy(&bytes[..split]).to_string();
        let path = head
            .strip_prefix("POST ")
            .unwrap_or("/completion")
            .to_string();
        let body = bytes.get(split + 1..).unwrap_or_default().to_vec();
        if let Some(why) = check(&server, &path, body.clone()).await {
            findings.push((why, corpus_case(&path, &body)));
        }
    }
    budget.keep_findings("server", findings.iter().map(|(_, case)| case.as_slice()));
    eprintln!(
        "{} random requests (seed {}) and {} kept ones: {} findings",
        budget.cases,
        budget.seed,
        kept.len(),
        findings.len()
    );
    let report: Vec<String> = findings
        .iter()
        .map(|(why, case)| format!("{why}\n{}", String::from_utf8_lossy(case)))
        .collect();
    assert!(findings.is_empty(), "{}", report.join("\n\n"));
}
