//! A job on its way through the engine, as the HTTP layer sees it: submitted, its events read
//! one by one (a stream) or to the end (a whole answer), with the counts of the request's log
//! line kept on the way.

use std::sync::atomic::Ordering;

use tokio::sync::mpsc::UnboundedReceiver;

use crate::engine::{Event, Job, SubmitError};
use crate::error::{engine_gone, job_error, ApiError};
use crate::log::{JobStats, RequestInfo};
use crate::response::Output;
use crate::state::AppState;

/// A submitted job whose first event has arrived: from here on the answer is a 200, or, for a
/// stream, events in the body. Dropping it drops the receiver, which cancels the job.
pub struct Run {
    rx: UnboundedReceiver<Event>,
    first: Option<Event>,
    /// The request field that held the prompt, for error objects.
    pub prompt_param: &'static str,
    pub request: RequestInfo,
    pub stats: JobStats,
}

impl Run {
    /// Submits `job` and waits for its first event, so that a job refused at once (a prompt too
    /// long for a slot) is still a 400 rather than an error inside a 200 stream. The wait
    /// includes the time in the queue.
    ///
    /// # Errors
    /// The queue is full, the server is stopping, or the engine refused the job.
    pub async fn start(
        state: &AppState,
        job: Job,
        prompt_param: &'static str,
        request: RequestInfo,
    ) -> Result<Self, ApiError> {
        let mut rx = state.engine.submit(job).inspect_err(|e| {
            if matches!(e, SubmitError::QueueFull { .. }) {
                state.rejected_queue_full.fetch_add(1, Ordering::Relaxed);
            }
        })?;
        let first = match rx.recv().await {
            None => return Err(engine_gone()),
            Some(Event::Failed(e)) => return Err(job_error(&e, prompt_param)),
            Some(first) => first,
        };
        Ok(Self {
            rx,
            // handed out (and counted) by the first `next`
            first: Some(first),
            prompt_param,
            request,
            stats: JobStats::default(),
        })
    }

    /// The next event, keeping the log's counts; `None` once the engine dropped the sender.
    pub async fn next(&mut self) -> Option<Event> {
        let event = match self.first.take() {
            Some(e) => e,
            None => self.rx.recv().await?,
        };
        match &event {
            Event::Started {
                slot,
                prompt_tokens,
                ..
            } => {
                self.stats.slot = Some(*slot);
                self.stats.prompt_tokens = Some(*prompt_tokens);
            }
            Event::Token { tokens, .. } => {
                self.stats
                    .ttft
                    .get_or_insert_with(|| self.request.start.elapsed());
                *self.stats.completion_tokens.get_or_insert(0) += tokens.len().max(1);
            }
            Event::Done {
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                self.stats.prompt_tokens = Some(*prompt_tokens);
                self.stats.completion_tokens = Some(*completion_tokens);
            }
            Event::Progress { .. } | Event::Failed(_) => {}
        }
        Some(event)
    }

    /// Reads the job to its end.
    ///
    /// # Errors
    /// The job failed, or the engine stopped.
    pub async fn collect(mut self) -> Result<(Output, JobStats), ApiError> {
        let mut out = Output::default();
        loop {
            let event = self.next().await;
            if let Some(e) = &event {
                out.record(e);
            }
            match event {
                Some(Event::Done { .. }) => return Ok((out, self.stats)),
                Some(Event::Failed(e)) => return Err(job_error(&e, self.prompt_param)),
                None => return Err(engine_gone()),
                Some(_) => {}
            }
        }
    }
}
