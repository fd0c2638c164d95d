//! Saving and restoring one sequence of a [`ParallelSession`] (llama-server's slot save and
//! restore): its tokens, KV cells and H2O state (llama.cpp's per-sequence state, which carries
//! the sequence's scores, memory sets and chunk bookkeeping), and the
//! session's own book of it (where its last prompt ended, how far its H2O state is a fresh
//! prefill's), so that a restored sequence reuses its prefix by the same rules as before.
//!
//! The file: `H2OSEQ01`, then little-endian u32s `prompt_end`, `fresh_until`, `n_tokens`, the
//! tokens (i32), a u64 byte count and llama.cpp's sequence state; saved behind a checked header
//! and atomically, and checked whole before it is used, as a session's state is (`state_file`).

use std::path::Path;

use super::super::state_file::{self, Integrity};
use super::{ParallelSession, SeqBook, SeqId};
use crate::backend;
use crate::error::{Error, Result};
use crate::model::Token;
use crate::sys;

const MAGIC: &[u8; 8] = b"H2OSEQ01";

impl ParallelSession<'_> {
    /// Saves sequence `seq` to `path`, atomically (`path` holds the old file or the new one
    /// whatever happens during the save); returns the tokens and the bytes written.
    ///
    /// With H2O, the sequence is first cut back to what a next prompt that continues it can
    /// reuse: the chunks before its last prompt's dense tail (or its first decoded token).
    /// Past that point a next prompt is evaluated anew in any case, and a restored sequence
    /// could not be cut back there: the H2O undo log that makes such a cut is not part of
    /// llama.cpp's state.
    ///
    /// # Errors
    /// [`Error::StateSave`] when llama.cpp cannot serialise the sequence or the file cannot be
    /// written (`path` is then unchanged); [`Error::InvalidConfig`] for a `seq` outside the
    /// session.
    pub fn save_seq(&mut self, seq: SeqId, path: &Path) -> Result<(usize, usize)> {
        self.check_seq(seq)?;
        let book = &self.seqs[seq as usize];
        if book.h2o.is_some() {
            let s = self.config.n_ubatch;
            let keep = book.n_past().min(book.fresh_until) / s * s;
            self.rewind(seq, keep);
        }
        let failed = |reason: String| Error::StateSave {
            to: path.display().to_string(),
            reason,
        };
        let book = &self.seqs[seq as usize];
        backend::clear_recent_log();
        // SAFETY: valid context; seq < n_seq_max.
        let size = unsafe { sys::llama_state_seq_get_size(self.ctx.as_ptr(), seq as i32) };
        let mut state = vec![0u8; size];
        // SAFETY: `size` writable bytes, as llama_state_seq_get_size asked for.
        let written = unsafe {
            sys::llama_state_seq_get_data(self.ctx.as_ptr(), state.as_mut_ptr(), size, seq as i32)
        };
        if size == 0 || written == 0 || written > size {
            return Err(failed(backend::recent_log_reason()));
        }
        state.truncate(written);
        let mut head = Vec::with_capacity(8 + 12 + 4 * book.tokens.len() + 8);
        head.extend_from_slice(MAGIC);
        for v in [book.prompt_end, book.fresh_until, book.n_past()] {
            head.extend_from_slice(&v.to_le_bytes());
        }
        for t in &book.tokens {
            head.extend_from_slice(&t.to_le_bytes());
        }
        head.extend_from_slice(&(written as u64).to_le_bytes());
        let bytes = state_file::write_atomic(path, &[&head, &state]).map_err(failed)?;
        Ok((book.tokens.len(), bytes as usize))
    }

    /// Replaces sequence `seq` with one saved by [`ParallelSession::save_seq`] (from any
    /// sequence of a session with the same model and settings); returns its token count and
    /// whether the file could be checked ([`Integrity::Unverified`]: saved before checked
    /// state files). The sequence runs the context's memory selection, which the state must
    /// have been saved with.
    ///
    /// # Errors
    /// [`Error::StateLoad`] naming the problem (no such file, damaged, truncated, not a saved
    /// sequence, more tokens than a sequence holds, another model or other H2O settings): the
    /// sequence is unchanged when refused before llama.cpp read the state (the whole file is
    /// checked first), empty when it failed there.
    pub fn load_seq(&mut self, seq: SeqId, path: &Path) -> Result<(usize, Integrity)> {
        self.check_seq(seq)?;
        let from = path.display().to_string();
        let refused = |reason: String| Error::StateLoad {
            from: from.clone(),
            reason,
            session: "the sequence is unchanged",
        };
        let bytes = state_file::read(path).map_err(&refused)?;
        let checked = state_file::check(&bytes).map_err(&refused)?;
        let (book, state) = parse(checked.state, self.n_ctx_seq).map_err(refused)?;
        self.clear(seq)?;
        backend::clear_recent_log();
        // SAFETY: valid context; llama.cpp reads at most `state.len()` bytes.
        let read = unsafe {
            sys::llama_state_seq_set_data(
                self.ctx.as_ptr(),
                state.as_ptr(),
                state.len(),
                seq as i32,
            )
        };
        if read == 0 || read != state.len() {
            let reason = if read == 0 {
                backend::recent_log_reason()
            } else {
                format!("llama.cpp read {read} of its {} bytes", state.len())
            };
            let _ = self.clear(seq);
            return Err(Error::StateLoad {
                from,
                reason,
                session: "the sequence is empty",
            });
        }
        let n = book.tokens.len();
        let h2o = self.seqs[seq as usize].h2o;
        self.seqs[seq as usize] = SeqBook { h2o, ..book };
        Ok((n, checked.integrity))
    }
}

/// Whether a saved sequence's own header (after the checked one) reads: for fuzzing.
pub(crate) fn parse_sequence(bytes: &[u8], n_ctx_seq: u32) -> std::result::Result<usize, String> {
    parse(bytes, n_ctx_seq).map(|(book, state)| book.tokens.len() + state.len())
}

/// The book and the llama.cpp state of a saved sequence.
fn parse(bytes: &[u8], n_ctx_seq: u32) -> std::result::Result<(SeqBook, &[u8]), String> {
    let u32_at = |at: usize| {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if bytes.get(..8) != Some(MAGIC.as_slice()) {
        return Err("not a sequence saved by h2o-llama (no H2OSEQ01 header)".into());
    }
    let (Some(prompt_end), Some(fresh_until), Some(n_tokens)) = (u32_at(8), u32_at(12), u32_at(16))
    else {
        return Err("truncated header".into());
    };
    if n_tokens > n_ctx_seq {
        return Err(format!(
            "the sequence holds {n_tokens} tokens, a sequence of this session {n_ctx_seq}: start \
             it with a larger context per sequence"
        ));
    }
    let tokens_end = 20 + 4 * n_tokens as usize;
    let tokens: Vec<Token> = bytes
        .get(20..tokens_end)
        .ok_or_else(|| format!("truncated: its {n_tokens} tokens are not all there"))?
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let size = bytes
        .get(tokens_end..tokens_end + 8)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
        .ok_or("truncated before the state")?;
    let state = bytes
        .get(tokens_end + 8..)
        .filter(|s| s.len() as u64 == size)
        .ok_or_else(|| format!("truncated: the state has fewer than its {size} bytes"))?;
    let book = SeqBook {
        tokens,
        prompt_end,
        fresh_until,
        h2o: None,
        decode_keys: Default::default(),
    };
    Ok((book, state))
}
