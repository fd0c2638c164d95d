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

use super::super::state_file::{self, Integrity, StateReader};
use super::super::state_stream::{self, Scope};
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
        // the state's length goes before it: llama.cpp's dry run counts it without copying
        // SAFETY: valid context; seq < n_seq_max.
        let size = unsafe { sys::llama_state_seq_get_size(self.ctx.as_ptr(), seq as i32) };
        if size == 0 {
            return Err(failed(backend::recent_log_reason()));
        }
        let mut head = Vec::with_capacity(8 + 12 + 4 * book.tokens.len() + 8);
        head.extend_from_slice(MAGIC);
        for v in [book.prompt_end, book.fresh_until, book.n_past()] {
            head.extend_from_slice(&v.to_le_bytes());
        }
        for t in &book.tokens {
            head.extend_from_slice(&t.to_le_bytes());
        }
        head.extend_from_slice(&(size as u64).to_le_bytes());
        let ctx = self.ctx;
        let bytes = state_file::write_atomic_with(path, |w| {
            w.write(&head).map_err(|e| e.to_string())?;
            let n = state_stream::write(ctx, Scope::Seq(seq as i32), &mut |p| w.write(p))?;
            if n != size {
                return Err(format!(
                    "llama.cpp gave {n} bytes of a sequence state it counted as {size}"
                ));
            }
            Ok(())
        })
        .map_err(failed)?;
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
        let mut reader = state_file::open_checked(path).map_err(&refused)?;
        let (book, size) = read_head(&mut reader, self.n_ctx_seq).map_err(&refused)?;
        let integrity = reader.integrity;
        self.clear(seq)?;
        let read = state_stream::read(
            self.ctx,
            Scope::Seq(seq as i32),
            &mut |dst| reader.read(dst),
            size as usize,
        );
        let outcome = match read {
            Ok(n) if n as u64 == size => reader.finish(),
            Ok(n) => Err(format!("llama.cpp read {n} of its {size} bytes")),
            Err(reason) => Err(reason),
        };
        if let Err(reason) = outcome {
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
        Ok((n, integrity))
    }
}

/// Reads a saved sequence's own header from `reader`: its book and the size of llama.cpp's
/// state, which must be all that is left.
fn read_head(
    reader: &mut StateReader,
    n_ctx_seq: u32,
) -> std::result::Result<(SeqBook, u64), String> {
    let mut head = vec![0u8; 20.min(reader.remaining() as usize)];
    reader.read(&mut head).map_err(|e| e.to_string())?;
    let n_tokens = token_count(&head, n_ctx_seq)?;
    let rest = (4 * n_tokens as u64 + 8).min(reader.remaining());
    head.resize(head.len() + rest as usize, 0);
    reader.read(&mut head[20..]).map_err(|e| e.to_string())?;
    let (book, end, size) = parse_book(&head, n_ctx_seq)?;
    debug_assert_eq!(end, head.len());
    if reader.remaining() != size {
        return Err(format!(
            "truncated: the state has fewer than its {size} bytes"
        ));
    }
    Ok((book, size))
}

/// Whether a saved sequence's own header (after the checked one) reads: for fuzzing.
pub(crate) fn parse_sequence(bytes: &[u8], n_ctx_seq: u32) -> std::result::Result<usize, String> {
    let (book, end, size) = parse_book(bytes, n_ctx_seq)?;
    if (bytes.len() - end) as u64 != size {
        return Err(format!(
            "truncated: the state has fewer than its {size} bytes"
        ));
    }
    Ok(book.tokens.len() + size as usize)
}

/// The token count of a saved sequence starting with `bytes`, once its magic and the room for
/// its tokens are checked.
fn token_count(bytes: &[u8], n_ctx_seq: u32) -> std::result::Result<u32, String> {
    if bytes.get(..8) != Some(MAGIC.as_slice()) {
        return Err("not a sequence saved by h2o-llama (no H2OSEQ01 header)".into());
    }
    let n_tokens = bytes
        .get(16..20)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .ok_or("truncated header")?;
    if n_tokens > n_ctx_seq {
        return Err(format!(
            "the sequence holds {n_tokens} tokens, a sequence of this session {n_ctx_seq}: start \
             it with a larger context per sequence"
        ));
    }
    Ok(n_tokens)
}

/// The book of a saved sequence, where its header ends in `bytes` and the byte count of the
/// llama.cpp state that follows.
fn parse_book(bytes: &[u8], n_ctx_seq: u32) -> std::result::Result<(SeqBook, usize, u64), String> {
    let n_tokens = token_count(bytes, n_ctx_seq)?;
    let u32_at =
        |at: usize| u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
    let (prompt_end, fresh_until) = (u32_at(8), u32_at(12));
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
    let book = SeqBook {
        tokens,
        prompt_end,
        fresh_until,
        h2o: None,
        decode_keys: Default::default(),
    };
    Ok((book, tokens_end + 8, size))
}
