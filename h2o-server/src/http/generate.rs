//! The generation endpoints: OpenAI's chat and text completions, and llama-server's
//! `/completion`. Each turns its body into jobs (`openai`), runs them (`run`), and answers whole
//! or as a stream (`sse`), in the shapes of `response`.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::Value;

use super::{ApiJson, Shared};
use crate::error::ApiError;
use crate::log::{JobStats, RequestInfo};
use crate::openai::{ChatRequest, CompletionRequest, InfillRequest, LlamaCompletionRequest};
use crate::response::{self, Head, LlamaShape, Output};
use crate::run::Run;
use crate::sse;

/// A JSON 200 whose log line carries the job's counts.
fn json_with_stats(body: &Value, stats: JobStats) -> Response {
    let mut response = Json(body).into_response();
    response.extensions_mut().insert(stats);
    response
}

pub async fn chat(
    State(state): State<Shared>,
    Extension(request): Extension<RequestInfo>,
    ApiJson(body): ApiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    let info = state.engine.info();
    let (mut jobs, mut delivery) = body.into_jobs(info, state.engine.jinja())?;
    let object = if delivery.stream {
        "chat.completion.chunk"
    } else {
        "chat.completion"
    };
    let head = Head::new("chatcmpl", object, info);
    let settings = settings_of(&jobs, info);
    if delivery.stream {
        // a stream has one choice (n > 1 is refused with stream)
        let run = Run::start(&state, jobs.remove(0), "messages", request).await?;
        let format = sse::Format::Chat {
            head,
            include_usage: delivery.include_usage,
            logprobs: delivery.probs,
            parser: delivery.reply_parsers.pop(),
        };
        return Ok(sse::respond(run, format, state.spell(), delivery.progress));
    }
    let (outs, stats) = run_all(&state, jobs, "messages", &request).await?;
    let spell = state.spell();
    let verbose = verbose_answer(&state, &outs, &settings);
    let mut parsers = delivery.reply_parsers.into_iter();
    let choices: Vec<response::ChatChoice> = outs
        .into_iter()
        .map(|out| {
            let logprobs = delivery
                .probs
                .then(|| response::prob_list(spell.as_ref(), &out.probs, false));
            // a reply the template's format does not take is sent as text, as it came
            let reply = parsers
                .next()
                .and_then(|mut p| p.update(&out.text, false).ok())
                .map(|(reply, _)| reply);
            response::ChatChoice {
                out,
                reply,
                logprobs,
            }
        })
        .collect();
    let mut body = response::chat_completion(&head, &choices);
    if let Some(v) = verbose {
        body["__verbose"] = v;
    }
    Ok(json_with_stats(&body, stats))
}

pub async fn completions(
    State(state): State<Shared>,
    Extension(request): Extension<RequestInfo>,
    ApiJson(body): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let info = state.engine.info();
    let (jobs, delivery) = body.into_job(info)?;
    let head = Head::new("cmpl", "text_completion", info);
    if delivery.stream {
        let job = jobs.into_iter().next().expect("a stream has one prompt");
        let run = Run::start(&state, job, "prompt", request).await?;
        let format = sse::Format::Text {
            head,
            include_usage: delivery.include_usage,
            logprobs: delivery.probs,
        };
        return Ok(sse::respond(run, format, state.spell(), delivery.progress));
    }
    let spell = state.spell();
    let settings = settings_of(&jobs, info);
    let (outs, stats) = run_all(&state, jobs, "prompt", &request).await?;
    let verbose = verbose_answer(&state, &outs, &settings);
    let outs: Vec<(Output, Option<Value>)> = outs
        .into_iter()
        .map(|o| {
            let lp = delivery
                .probs
                .then(|| response::legacy_logprobs(spell.as_ref(), &o.probs, 0));
            (o, lp)
        })
        .collect();
    let mut body = response::text_completion(&head, &outs);
    if let Some(v) = verbose {
        body["__verbose"] = v;
    }
    Ok(json_with_stats(&body, stats))
}

/// Each job's `generation_settings`.
fn settings_of(jobs: &[crate::engine::Job], info: &crate::engine::EngineInfo) -> Vec<Value> {
    jobs.iter()
        .map(|j| response::generation_settings(&j.sampling, info))
        .collect()
}

/// llama-server's `__verbose` under `--verbose`: the first output's `/completion` answer.
fn verbose_answer(state: &Shared, outs: &[Output], settings: &[Value]) -> Option<Value> {
    let (out, settings) = outs.first().zip(settings.first())?;
    if !state.options.verbose {
        return None;
    }
    let spell = state.spell();
    let shape = LlamaShape {
        probs: false,
        probs_linear: false,
        return_tokens: true,
        response_fields: None,
    };
    let prompt = sse::prompt_text(spell.as_ref(), &out.prompt);
    Some(response::llama_final(
        &out.text,
        out,
        settings,
        state.engine.info(),
        &shape,
        spell.as_ref(),
        &prompt,
    ))
}

pub async fn llama_completion(
    State(state): State<Shared>,
    Extension(request): Extension<RequestInfo>,
    ApiJson(body): ApiJson<LlamaCompletionRequest>,
) -> Result<Response, ApiError> {
    let info = state.engine.info().clone();
    let (jobs, delivery) = body.into_job(&info)?;
    llama_answer(&state, request, jobs, delivery, info).await
}

/// llama-server's `POST /infill`: code completion between `input_prefix` and `input_suffix`
/// with the model's fill-in-the-middle tokens, answered as `/completion` answers.
pub async fn infill(
    State(state): State<Shared>,
    Extension(request): Extension<RequestInfo>,
    ApiJson(body): ApiJson<InfillRequest>,
) -> Result<Response, ApiError> {
    let info = state.engine.info().clone();
    let (job, delivery) = body.into_job(&info)?;
    llama_answer(&state, request, vec![job], delivery, info).await
}

/// `/completion`'s answer to `jobs`: a stream of one, or each job's object in order.
async fn llama_answer(
    state: &Shared,
    request: RequestInfo,
    jobs: Vec<crate::engine::Job>,
    delivery: crate::openai::Delivery,
    info: crate::engine::EngineInfo,
) -> Result<Response, ApiError> {
    let shape = LlamaShape {
        probs: delivery.probs,
        probs_linear: delivery.probs_linear,
        return_tokens: delivery.return_tokens,
        response_fields: delivery.response_fields.clone(),
    };
    let settings = settings_of(&jobs, &info);
    let spell = state.spell();
    if delivery.stream {
        let job = jobs.into_iter().next().expect("a stream has one prompt");
        let run = Run::start(state, job, "prompt", request).await?;
        let format = sse::Format::Llama {
            shape,
            settings: settings[0].clone(),
            info,
        };
        return Ok(sse::respond(run, format, spell, delivery.progress));
    }
    let n = jobs.len();
    let (outs, stats) = run_all(state, jobs, "prompt", &request).await?;
    let mut answers: Vec<Value> = outs
        .iter()
        .zip(&settings)
        .enumerate()
        .map(|(i, (out, settings))| {
            let prompt = sse::prompt_text(spell.as_ref(), &out.prompt);
            let mut v = response::llama_final(
                &out.text,
                out,
                settings,
                &info,
                &shape,
                spell.as_ref(),
                &prompt,
            );
            if v.get("index").is_some() {
                v["index"] = i.into();
            }
            v
        })
        .collect();
    // one prompt: its object; several: an array of them, in order (llama-server's shapes)
    let body = if n == 1 {
        answers.remove(0)
    } else {
        Value::Array(answers)
    };
    Ok(json_with_stats(&body, stats))
}

/// Runs a request's jobs side by side (each takes a slot as one frees up) and collects their
/// outputs in order; the log's counts are summed.
async fn run_all(
    state: &Shared,
    jobs: Vec<crate::engine::Job>,
    prompt_param: &'static str,
    request: &RequestInfo,
) -> Result<(Vec<Output>, JobStats), ApiError> {
    let mut runs = Vec::with_capacity(jobs.len());
    for job in jobs {
        runs.push(Run::start(state, job, prompt_param, request.clone()).await?);
    }
    let results = futures_util::future::join_all(runs.into_iter().map(Run::collect)).await;
    let mut outs = Vec::with_capacity(results.len());
    let mut total = JobStats::default();
    for r in results {
        let (out, stats) = r?;
        total.slot = total.slot.or(stats.slot);
        total.ttft = total.ttft.or(stats.ttft);
        total.prompt_tokens =
            Some(total.prompt_tokens.unwrap_or(0) + stats.prompt_tokens.unwrap_or(0));
        total.completion_tokens =
            Some(total.completion_tokens.unwrap_or(0) + stats.completion_tokens.unwrap_or(0));
        outs.push(out);
    }
    Ok((outs, total))
}
