//! `/metrics` in Prometheus' text exposition format (version 0.0.4): the engine's counters, the
//! rates derived from them, and the slot and queue gauges.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::engine::{EngineInfo, Metrics};

pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The exposition text.
pub fn render(m: &Metrics, info: &EngineInfo, rejected_queue_full: u64) -> String {
    let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let prompt_tokens = get(&m.prompt_tokens_total);
    let generated_tokens = get(&m.generated_tokens_total);
    let prefill_s = get(&m.prefill_us_total) as f64 / 1e6;
    let decode_s = get(&m.decode_us_total) as f64 / 1e6;
    let rate = |n: u64, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };

    let mut out = String::new();
    let mut sample = |name: String, kind: &str, help: &str, value: String| {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        let _ = writeln!(out, "{name} {value}");
    };
    let mut metric = |name: &str, kind: &str, help: &str, value: String| {
        sample(format!("h2o_server_{name}"), kind, help, value);
    };
    let int = |v: u64| v.to_string();
    let float = |v: f64| format!("{v:.6}");
    metric(
        "requests_total",
        "counter",
        "Jobs the engine accepted.",
        int(get(&m.requests_total)),
    );
    metric(
        "requests_failed_total",
        "counter",
        "Jobs that ended with an error.",
        int(get(&m.requests_failed)),
    );
    metric(
        "requests_cancelled_total",
        "counter",
        "Jobs cancelled because the client went away (or at shutdown).",
        int(get(&m.requests_cancelled)),
    );
    metric(
        "requests_rejected_total",
        "counter",
        "Requests answered 503 because the queue was full.",
        int(rejected_queue_full),
    );
    metric(
        "prompt_tokens_total",
        "counter",
        "Prompt tokens evaluated.",
        int(prompt_tokens),
    );
    metric(
        "generated_tokens_total",
        "counter",
        "Tokens generated.",
        int(generated_tokens),
    );
    metric(
        "prefill_seconds_total",
        "counter",
        "Time spent evaluating prompts.",
        float(prefill_s),
    );
    metric(
        "decode_seconds_total",
        "counter",
        "Time spent in decode steps.",
        float(decode_s),
    );
    metric(
        "prefill_tokens_per_second",
        "gauge",
        "Prompt tokens evaluated per second of prefill, since start.",
        float(rate(prompt_tokens, prefill_s)),
    );
    metric(
        "decode_tokens_per_second",
        "gauge",
        "Tokens generated per second of decoding, since start.",
        float(rate(generated_tokens, decode_s)),
    );
    metric(
        "slots",
        "gauge",
        "Slots (-np): requests served at the same time.",
        int(u64::from(info.n_parallel)),
    );
    metric(
        "slots_busy",
        "gauge",
        "Slots serving a request.",
        int(get(&m.slots_busy)),
    );
    metric(
        "queue_length",
        "gauge",
        "Requests waiting for a slot.",
        int(get(&m.queue_len)),
    );
    // llama-server's names, for the dashboards and clients built on them
    let cached = get(&m.prompt_tokens_cached_total);
    let mut llama = |name: &str, kind: &str, help: &str, value: String| {
        sample(format!("llamacpp:{name}"), kind, help, value);
    };
    llama(
        "prompt_tokens_total",
        "counter",
        "Number of prompt tokens processed.",
        int(prompt_tokens),
    );
    llama(
        "prompt_seconds_total",
        "counter",
        "Prompt process time.",
        float(prefill_s),
    );
    llama(
        "tokens_predicted_total",
        "counter",
        "Number of generation tokens processed.",
        int(generated_tokens),
    );
    llama(
        "tokens_predicted_seconds_total",
        "counter",
        "Predict process time.",
        float(decode_s),
    );
    llama(
        "prompt_tokens_cache_total",
        "counter",
        "Prompt tokens reused from a slot's cache.",
        int(cached),
    );
    llama(
        "prompt_cache_hit_ratio",
        "gauge",
        "Share of prompt tokens reused from a slot's cache.",
        float(if cached + prompt_tokens > 0 {
            cached as f64 / (cached + prompt_tokens) as f64
        } else {
            0.0
        }),
    );
    llama(
        "prompt_tokens_seconds",
        "gauge",
        "Average prompt throughput in tokens/s.",
        float(rate(prompt_tokens, prefill_s)),
    );
    llama(
        "predicted_tokens_seconds",
        "gauge",
        "Average generation throughput in tokens/s.",
        float(rate(generated_tokens, decode_s)),
    );
    llama(
        "requests_processing",
        "gauge",
        "Number of requests processing.",
        int(get(&m.slots_busy)),
    );
    llama(
        "requests_deferred",
        "gauge",
        "Number of requests deferred.",
        int(get(&m.queue_len)),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_has_help_and_type_and_a_number() {
        let m = Metrics::default();
        Metrics::add(&m.prompt_tokens_total, 1000);
        Metrics::add(&m.prefill_us_total, 500_000);
        Metrics::add(&m.slots_busy, 2);
        let info = EngineInfo {
            model_id: "m.gguf".into(),
            n_parallel: 4,
            n_ctx_slot: 512,
            n_ubatch: 64,
            flash_attn: h2o_llama::FlashAttention::Off,
            h2o: None,
            h2o_auto: None,
            fim: h2o_llama::FimTokens::default(),
            created: 0,
            n_vocab: 256,
            aliases: Vec::new(),
            tags: Vec::new(),
            model_file: "m.gguf".into(),
            defaults: crate::engine::RequestDefaults::default(),
        };
        let text = render(&m, &info, 3);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len() % 3, 0);
        for triple in lines.chunks(3) {
            let name = triple[2].split(' ').next().unwrap();
            assert!(
                name.starts_with("h2o_server_") || name.starts_with("llamacpp:"),
                "{name}"
            );
            assert!(
                triple[0].starts_with(&format!("# HELP {name} ")),
                "{triple:?}"
            );
            assert!(
                triple[1] == format!("# TYPE {name} counter")
                    || triple[1] == format!("# TYPE {name} gauge"),
                "{triple:?}"
            );
            assert!(
                !name.ends_with("_total") || triple[1].ends_with("counter"),
                "{triple:?}"
            );
            let value: f64 = triple[2].split(' ').nth(1).unwrap().parse().unwrap();
            assert!(value.is_finite());
        }
        assert!(text.contains("h2o_server_prefill_tokens_per_second 2000.000000\n"));
        assert!(text.contains("h2o_server_slots_busy 2\n"));
        assert!(text.contains("h2o_server_slots 4\n"));
        assert!(text.contains("h2o_server_requests_rejected_total 3\n"));
    }
}
