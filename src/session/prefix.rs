//! Cutting the session back to a prefix of its tokens, and evaluating a prompt that starts with
//! part of what the session holds: what llama-cli and llama-server do to reuse a cached prompt
//! (regenerate, the next turn of a chat), kept exactly equal to a fresh session's result under
//! H2O (the KV cache's cut at `prompt_end` and its undo log).

use super::{H2oConfig, Session, SessionConfig};
use crate::backend;
use crate::error::{Error, Result};
use crate::model::Token;
use crate::sys;

impl Session<'_> {
    /// Keeps the first `n` tokens of the session and forgets the rest, as llama-cli and
    /// llama-server do to reuse a cached prompt prefix (regenerate, the next turn of a chat).
    /// Returns how many tokens had to be evaluated again.
    ///
    /// With full attention llama.cpp cuts the cache and nothing is evaluated again. With H2O:
    /// - where only decoded tokens go, the cache is cut as it is (they never entered the H2O
    ///   state), and the session is the one that decoded fewer;
    /// - otherwise the session becomes exactly what a fresh session gives that evaluates the kept
    ///   tokens. With [`SessionConfig::h2o_undo_log`], llama.cpp puts the H2O state back at a
    ///   chunk boundary below `n` (the undo log) and the tokens from there are evaluated again, in
    ///   the calls a fresh session makes. The boundary is the last one before where a fresh
    ///   prefill's dense tail would start, and before any dense tail or decoded token in the
    ///   session's own history (which a fresh prefill does not have). Without the undo log, or
    ///   where it cannot go back that far, the kept tokens are evaluated again from an empty
    ///   cache.
    ///
    /// [`Session::logits`] is `None` afterwards.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when `n` exceeds [`Session::n_past`]; as
    /// [`Session::evaluate`] while evaluating again (the session is then empty).
    pub fn truncate(&mut self, n: u32) -> Result<usize> {
        if n > self.n_past {
            return Err(Error::InvalidConfig(format!(
                "cannot keep {n} tokens: the session holds {}",
                self.n_past
            )));
        }
        self.has_logits = false;
        if n == self.n_past || ((self.h2o().is_none() || n >= self.prompt_end) && self.cut(n)) {
            return Ok(0);
        }
        let kept = self.tokens[..n as usize].to_vec();
        let from = self.rewind(self.reusable(n, n)) as usize;
        if from < kept.len() {
            self.evaluate_in_calls(&kept[from..], true, true, |_, _| {})?;
        }
        self.has_logits = false;
        Ok(kept.len() - from)
    }

    /// Evaluates `prompt` as a fresh session would, reusing the part of it the session already
    /// holds, as llama-server does for a slot's next request: the cache is cut back to where
    /// `prompt` and the session's tokens part (with H2O, to the chunk boundary
    /// [`Session::truncate`] would choose for a fresh prefill of all of `prompt`), and the rest
    /// is evaluated in the calls a fresh session makes. Returns how many tokens were reused.
    /// At least the last token of `prompt` is evaluated, so that [`Session::logits`] hold its
    /// next-token logits.
    ///
    /// # Errors
    /// As [`Session::evaluate`] ([`Error::EmptyPrompt`], [`Error::PromptTooLong`] when `prompt`
    /// is longer than the context, …).
    pub fn evaluate_reusing(&mut self, prompt: &[Token]) -> Result<usize> {
        if prompt.is_empty() {
            return Err(Error::EmptyPrompt);
        }
        let n = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
        let common = super::state::common_prefix(&self.tokens, prompt).min(prompt.len() - 1);
        let keep = if n <= self.n_ctx {
            self.rewind(self.reusable(n, common as u32))
        } else {
            0 // too long: evaluate_in_calls refuses it, and the session stays as it is
        };
        self.evaluate_in_calls(&prompt[keep as usize..], true, true, |_, _| {})?;
        Ok(keep as usize)
    }

    /// llama-cli's `--prompt-cache`, made so that reusing the cache equals a fresh run: evaluates
    /// `rest`, the prompt after the tokens the session holds (none, or a cache that
    /// [`Session::load_prompt_cache`] reused), in the calls a fresh session evaluating the whole
    /// prompt makes, and saves to `path` the state that a later prompt beginning with this one can
    /// reuse exactly. With full attention that is the state after the whole prompt. With H2O it
    /// is the state at the chunk boundary before this prompt's dense tail: a state saved after the
    /// tail (which scores nothing) or inside a chunk (whose memory is chosen with the rows it has)
    /// would make the continuation differ from a fresh prefill. So the evaluation stops at that
    /// boundary for the save, then goes on; its result is a fresh session's. Returns the tokens
    /// saved, or `None` when the session already held that boundary or more (the file is then
    /// left as it is: it holds the same prefix or a longer one).
    ///
    /// # Errors
    /// As [`Session::evaluate`]; [`Error::StateSave`] when the file cannot be written.
    pub fn evaluate_saving_prompt_cache(
        &mut self,
        rest: &[Token],
        path: &std::path::Path,
        mut progress: impl FnMut(usize, usize),
    ) -> Result<Option<usize>> {
        self.check_prompt(rest)?;
        let n_past = self.n_past as usize;
        let n = u32::try_from(n_past + rest.len()).unwrap_or(u32::MAX);
        let boundary = self.reusable(n, n) as usize;
        if boundary <= n_past {
            self.evaluate_in_calls(rest, true, true, progress)?;
            return Ok(None);
        }
        let first = boundary - n_past;
        let total = rest.len();
        if first < total {
            self.evaluate_in_calls(&rest[..first], true, false, |done, _| {
                progress(done, total);
            })?;
            self.save_state(path)?;
            self.evaluate_in_calls(&rest[first..], true, true, |done, _| {
                progress(first + done, total);
            })?;
        } else {
            self.evaluate_in_calls(rest, true, true, progress)?;
            self.save_state(path)?;
        }
        Ok(Some(boundary))
    }

    /// How many of the session's first `common` tokens a session can keep and end up, once it
    /// has evaluated the rest of a prompt of `n` tokens, exactly where a fresh session
    /// evaluating that prompt ends up: all of them with full attention; with H2O, up to the
    /// chunk boundary before the fresh prefill's dense tail and before anything in the
    /// session's history a fresh prefill does not have.
    pub(super) fn reusable(&self, n: u32, common: u32) -> u32 {
        reusable(self.h2o(), &self.config, n, common, self.fresh_until)
    }

    /// Cuts the cache back to its first `keep` tokens, or empties it where llama.cpp refuses
    /// the cut; returns the tokens kept.
    fn rewind(&mut self, keep: u32) -> u32 {
        if keep > 0 && self.cut(keep) {
            // `keep` is at most `fresh_until`, and nothing of the history after it is left
            self.fresh_until = u32::MAX;
            keep
        } else {
            self.reset();
            0
        }
    }

    /// `llama_memory_seq_rm` keeping positions `[0, n)`; false where llama.cpp refuses the cut
    /// (the cache is then unchanged).
    fn cut(&mut self, n: u32) -> bool {
        backend::clear_recent_log();
        // SAFETY: valid context and its memory; n <= n_past fits in i32 (n_ctx does).
        let cut = unsafe {
            sys::llama_memory_seq_rm(sys::llama_get_memory(self.ctx.as_ptr()), 0, n as i32, -1)
        };
        if cut {
            self.n_past = n;
            self.tokens.truncate(n as usize);
            self.prompt_end = self.prompt_end.min(n);
            self.decode_keys = Default::default();
        }
        cut
    }
}

/// How many of a sequence's first `common` tokens can be kept so that, once the rest of a prompt
/// of `n` tokens is evaluated in the calls a fresh sequence makes, the sequence is exactly a fresh
/// one: all of them with full attention; with H2O (`h2o`), up to the chunk boundary before the
/// fresh prefill's dense tail and before `fresh_until`, the first position of the sequence's own
/// history a fresh prefill does not have (a dense tail, a decoded token).
pub(super) fn reusable(
    h2o: Option<H2oConfig>,
    config: &SessionConfig,
    n: u32,
    common: u32,
    fresh_until: u32,
) -> u32 {
    if h2o.is_none() {
        return common;
    }
    let s = config.n_ubatch;
    common
        .min(fresh_tail_start(h2o, config.n_batch, n))
        .min(fresh_until)
        / s
        * s
}

/// Where the H2O state of a fresh sequence that evaluates `n` tokens in calls of `n_batch` stops
/// being a plain prefill's: its last call's dense tail, or its last call when that holds one
/// token (decode); `n` when neither.
fn fresh_tail_start(h2o: Option<H2oConfig>, n_batch: u32, n: u32) -> u32 {
    let last_call = (n.max(1) - 1) / n_batch * n_batch;
    match h2o {
        Some(_) if n_batch == 1 => 0,
        Some(_) => super::unscored_from(h2o, last_call, (n - last_call) as usize, true).min(n),
        None => n,
    }
}
