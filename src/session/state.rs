//! Saving and loading a session: its tokens, its KV cache and, with H2O, the scores, memory sets,
//! chunk sums and chunk bookkeeping that go with them. The state is llama.cpp's
//! session file (what `llama_state_save_file` writes; [`Session::state_bytes`] in memory),
//! saved behind a checked header and atomically (`state_file`): a file is the old state or the
//! new one after any crash, and a damaged or cut file is refused before it reaches llama.cpp.
//! Files saved before checked state files (llama.cpp's format alone) are still read, unverified.
//!
//! A state is refused, never half loaded: a state from another model, with other H2O settings,
//! without H2O state for an H2O session (or with it for a full-attention one) is refused before
//! the session changes; one that fails part-way inside llama.cpp leaves the session empty.

use std::path::Path;

use super::state_file::{self, Integrity, StateReader};
use super::state_stream::{self, Scope};
use super::Session;
use crate::backend;
use crate::error::{Error, Result};
use crate::model::Token;
use crate::sys;

/// Bytes before the tokens: magic, version, token count.
const HEADER_BYTES: usize = 12;

/// What [`Session::load_prompt_cache`] did with a prompt-cache file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptCache {
    /// There is no such file yet.
    Missing,
    /// The file's tokens begin the prompt: they were loaded, and the rest of the prompt is
    /// `prompt[tokens..]`. `integrity` says whether the file could be checked.
    Reused { tokens: usize, integrity: Integrity },
    /// The file's tokens (`cached` of them) do not begin the prompt, or are all of it: nothing
    /// was loaded. `common` is how many leading tokens agree.
    Unused { common: usize, cached: usize },
    /// The file's tokens begin the prompt, but under H2O its state is not what a fresh prefill
    /// of them leaves (a dense tail ran, or a chunk was left open: a state saved after a whole
    /// prompt or after generating), so continuing it would differ from a fresh run of the
    /// prompt: nothing was loaded.
    NotFresh { cached: usize },
    /// The file's tokens begin the prompt, but under H2O the prompt is short enough that a fresh
    /// run of it attends densely (its dense tail) to the last of them, which the state scored
    /// as a sparse chunk: nothing was loaded.
    EndsInTail { cached: usize },
}

/// The header of a session state: the tokens it holds, and where its llama.cpp state begins.
#[derive(Debug)]
struct Header {
    tokens: Vec<Token>,
    state_offset: usize,
}

/// The token count of a session state starting with `bytes`, once its magic, its version and
/// the context's room for its tokens are checked.
fn token_count(bytes: &[u8], n_ctx: u32) -> std::result::Result<u32, String> {
    let u32_at = |at: usize| {
        bytes
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let (Some(magic), Some(version), Some(n_tokens)) = (u32_at(0), u32_at(4), u32_at(8)) else {
        return Err(format!(
            "{} bytes are too short for a llama.cpp session state",
            bytes.len()
        ));
    };
    if magic != sys::LLAMA_SESSION_MAGIC {
        return Err(format!(
            "not a llama.cpp session state (magic {magic:#010x}, expected {:#010x})",
            sys::LLAMA_SESSION_MAGIC
        ));
    }
    if version != sys::LLAMA_SESSION_VERSION {
        return Err(format!(
            "session state version {version}, this build reads version {}",
            sys::LLAMA_SESSION_VERSION
        ));
    }
    if n_tokens > n_ctx {
        return Err(format!(
            "the state holds {n_tokens} tokens, the context has room for {n_ctx}: create the session \
             with a larger context (-c)"
        ));
    }
    Ok(n_tokens)
}

fn parse_header(bytes: &[u8], n_ctx: u32) -> std::result::Result<Header, String> {
    let n_tokens = token_count(bytes, n_ctx)?;
    let state_offset = HEADER_BYTES + 4 * n_tokens as usize;
    if bytes.len() < state_offset {
        return Err(format!(
            "truncated: {} bytes, its {n_tokens} tokens alone need {state_offset}",
            bytes.len()
        ));
    }
    let tokens = bytes[HEADER_BYTES..state_offset]
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    Ok(Header {
        tokens,
        state_offset,
    })
}

/// A session file checked whole (`state_file`) and read up to llama.cpp's state: nothing
/// reaches the context before this succeeds.
struct CheckedFile {
    /// positioned where llama.cpp's state (after the session header and its tokens) starts
    reader: StateReader,
    tokens: Vec<Token>,
}

fn open_checked(path: &Path, n_ctx: u32) -> std::result::Result<CheckedFile, String> {
    let mut reader = state_file::open_checked(path)?;
    let mut head = vec![0u8; HEADER_BYTES.min(reader.remaining() as usize)];
    reader.read(&mut head).map_err(|e| e.to_string())?;
    let n_tokens = token_count(&head, n_ctx)?;
    let tokens_len = (4 * n_tokens as u64).min(reader.remaining());
    head.resize(HEADER_BYTES + tokens_len as usize, 0);
    reader
        .read(&mut head[HEADER_BYTES..])
        .map_err(|e| e.to_string())?;
    let header = parse_header(&head, n_ctx)?;
    Ok(CheckedFile {
        reader,
        tokens: header.tokens,
    })
}

/// What follows the `read` bytes of a state of `len` that llama.cpp read.
fn unread_tail(read: usize, len: u64) -> String {
    format!(
        "{} bytes follow the state llama.cpp read ({read} of {len}): a damaged state, or one \
         saved with other settings",
        len - read as u64
    )
}

/// Whether a session file's own header (after the checked one) reads: for fuzzing.
pub(crate) fn parse_session(bytes: &[u8], n_ctx: u32) -> std::result::Result<usize, String> {
    parse_header(bytes, n_ctx).map(|h| h.tokens.len())
}

/// How many leading tokens `a` and `b` share.
pub(super) fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Session<'_> {
    /// Saves the session (its tokens, KV cache and H2O state) to `path`: llama.cpp's session
    /// state behind a checked header, written atomically (a temporary file in the same
    /// directory, flushed and renamed over `path`), so that `path` holds the old state or the
    /// new one whatever happens during the save. The state streams from the cache to the file
    /// through the checksum in pieces: no copy of it is held. Logits are not part of a state:
    /// after a load, evaluate at least one token before sampling.
    ///
    /// # Errors
    /// [`Error::StateSave`] when llama.cpp cannot serialise the state or the file cannot be
    /// written (a full disk, no permission); `path` is then unchanged.
    pub fn save_state(&mut self, path: &Path) -> Result<()> {
        let failed = |reason: String| Error::StateSave {
            to: path.display().to_string(),
            reason,
        };
        let head = self.session_head(0).map_err(failed)?;
        let ctx = self.ctx;
        state_file::write_atomic_with(path, |w| {
            w.write(&head).map_err(|e| e.to_string())?;
            state_stream::write(ctx, Scope::Context, &mut |piece| w.write(piece)).map(|_| ())
        })
        .map_err(failed)?;
        Ok(())
    }

    /// The session's state as bytes: llama.cpp's session state, what [`Session::save_state`]
    /// writes to a file after its checked header.
    ///
    /// # Errors
    /// [`Error::StateSave`] when llama.cpp cannot serialise the state.
    pub fn state_bytes(&mut self) -> Result<Vec<u8>> {
        let failed = |reason: String| Error::StateSave {
            to: "memory".into(),
            reason,
        };
        backend::clear_recent_log();
        // SAFETY: valid context.
        let size = unsafe { sys::llama_state_get_size(self.ctx.as_ptr()) };
        if size == 0 {
            return Err(failed(backend::recent_log_reason()));
        }
        let mut bytes = self.session_head(size).map_err(failed)?;
        let offset = bytes.len();
        bytes.resize(offset + size, 0);
        // SAFETY: `size` writable bytes from `offset`, as llama_state_get_size asked for.
        let written = unsafe {
            sys::llama_state_get_data(self.ctx.as_ptr(), bytes[offset..].as_mut_ptr(), size)
        };
        if written == 0 || written > size {
            return Err(failed(backend::recent_log_reason()));
        }
        bytes.truncate(offset + written);
        Ok(bytes)
    }

    /// llama.cpp's session header and the session's tokens, in a buffer with room for `more`
    /// bytes after them.
    fn session_head(&self, more: usize) -> std::result::Result<Vec<u8>, String> {
        let n_tokens = u32::try_from(self.tokens.len()).map_err(|_| "too many tokens")?;
        let mut head = Vec::with_capacity(HEADER_BYTES + 4 * self.tokens.len() + more);
        head.extend_from_slice(&sys::LLAMA_SESSION_MAGIC.to_le_bytes());
        head.extend_from_slice(&sys::LLAMA_SESSION_VERSION.to_le_bytes());
        head.extend_from_slice(&n_tokens.to_le_bytes());
        for t in &self.tokens {
            head.extend_from_slice(&t.to_le_bytes());
        }
        Ok(head)
    }

    /// Replaces the session's content with a state saved by [`Session::save_state`] (or, as
    /// [`Integrity::Unverified`], by an earlier version or llama.cpp's
    /// `llama_state_save_file` with the same model and settings). The whole file is checked
    /// before any of it reaches the context.
    ///
    /// # Errors
    /// [`Error::StateLoad`] naming the problem (no such file, damaged, truncated, not a session
    /// state, another model, other H2O settings, H2O state missing or unexpected) and what the
    /// session holds afterwards: unchanged when refused up front, empty when the state failed
    /// part-way inside llama.cpp.
    pub fn load_state(&mut self, path: &Path) -> Result<Integrity> {
        let from = path.display().to_string();
        let file = open_checked(path, self.n_ctx).map_err(|reason| Error::StateLoad {
            from: from.clone(),
            reason,
            session: "the session is unchanged",
        })?;
        self.set_state_from(file.reader, file.tokens, from)
    }

    /// [`Session::load_state`] from bytes: those of [`Session::state_bytes`], or a whole file
    /// that [`Session::save_state`] wrote (checked the same way).
    ///
    /// # Errors
    /// As [`Session::load_state`].
    pub fn load_state_bytes(&mut self, bytes: &[u8]) -> Result<Integrity> {
        let from = "memory".to_string();
        let refused = |reason: String| Error::StateLoad {
            from: from.clone(),
            reason,
            session: "the session is unchanged",
        };
        let checked = state_file::check(bytes).map_err(refused)?;
        let header = parse_header(checked.state, self.n_ctx).map_err(refused)?;
        let state = &checked.state[header.state_offset..];
        self.set_state(state, header.tokens, from)?;
        Ok(checked.integrity)
    }

    /// Hands llama.cpp a checked state (after its session header) and takes over its tokens.
    fn set_state(&mut self, state: &[u8], tokens: Vec<Token>, from: String) -> Result<()> {
        backend::clear_recent_log();
        // SAFETY: valid context; llama.cpp reads at most `state.len()` bytes.
        let read =
            unsafe { sys::llama_state_set_data(self.ctx.as_ptr(), state.as_ptr(), state.len()) };
        let (outcome, loaded) = if read == 0 {
            (Err(backend::recent_log_reason()), false)
        } else if read != state.len() {
            (Err(unread_tail(read, state.len() as u64)), true)
        } else {
            (Ok(()), true)
        };
        self.finish_load(outcome, loaded, tokens, from)
    }

    /// [`Session::set_state`] streaming from a checked file: llama.cpp reads it piece by piece
    /// into the cache, and the pieces are checked once more on the way (a file changed since it
    /// was checked empties the session).
    fn set_state_from(
        &mut self,
        mut reader: StateReader,
        tokens: Vec<Token>,
        from: String,
    ) -> Result<Integrity> {
        let integrity = reader.integrity;
        let len = reader.remaining();
        let read = state_stream::read(
            self.ctx,
            Scope::Context,
            &mut |dst| reader.read(dst),
            len as usize,
        );
        let (outcome, loaded) = match read {
            Err(reason) => (Err(reason), false),
            Ok(n) if (n as u64) < len => (Err(unread_tail(n, len)), true),
            Ok(_) => (reader.finish(), true),
        };
        self.finish_load(outcome, loaded, tokens, from)?;
        Ok(integrity)
    }

    /// Takes over the tokens of a state llama.cpp loaded, or, when it failed, says what the
    /// session holds: llama.cpp refuses a foreign or mismatched state before it changes the
    /// cache and empties the cache when a state fails part-way, so an unchanged cache is told
    /// by its size unless the state would have left the same size; anything else is emptied.
    fn finish_load(
        &mut self,
        outcome: std::result::Result<(), String>,
        changed: bool,
        tokens: Vec<Token>,
        from: String,
    ) -> Result<()> {
        let outcome = outcome.and_then(|()| {
            let n_cached = self.cached_positions();
            if n_cached == tokens.len() {
                Ok(())
            } else {
                Err(format!(
                    "the state lists {} tokens but its cache holds {n_cached} positions",
                    tokens.len()
                ))
            }
        });
        if let Err(reason) = outcome {
            let n_past = self.n_past as usize;
            let unchanged = !changed
                && self.cached_positions() == n_past
                && (n_past == 0 || n_past != tokens.len());
            let session = if unchanged {
                "the session is unchanged"
            } else {
                self.reset();
                "the session was emptied"
            };
            return Err(Error::StateLoad {
                from,
                reason,
                session,
            });
        }
        if let Some(sink) = &self.capture {
            sink.clear();
        }
        self.n_past = tokens.len() as u32; // <= n_ctx (parse_header)
        self.tokens = tokens;
        // the state's history is not known: a later truncate evaluates the kept tokens again
        self.prompt_end = self.n_past;
        self.fresh_until = 0;
        self.decode_keys = Default::default();
        self.has_logits = false;
        Ok(())
    }

    /// Positions the cache holds for the session's sequence (0 when empty).
    fn cached_positions(&self) -> usize {
        // SAFETY: valid context and its memory.
        let pos_max =
            unsafe { sys::llama_memory_seq_pos_max(sys::llama_get_memory(self.ctx.as_ptr()), 0) };
        usize::try_from(pos_max + 1).unwrap_or(0)
    }

    /// llama-cli's `--prompt-cache`: when the state saved at `path` holds tokens that begin
    /// `prompt` (and are not all of it, since a state has no logits), loads it into this empty
    /// session, so that only `prompt[tokens..]` remains to evaluate. Otherwise the session stays
    /// empty (the state is still loaded once, to check that it fits); after evaluating the
    /// prompt, [`Session::save_state`] to `path` refreshes it.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] when the session is not empty; [`Error::StateLoad`] when the
    /// file cannot be read, is damaged or truncated, is not a session state, or does not fit
    /// this session (another model, other H2O settings): a damaged cache, or one made for
    /// other settings, is neither used nor silently replaced.
    pub fn load_prompt_cache(&mut self, path: &Path, prompt: &[Token]) -> Result<PromptCache> {
        if self.n_past > 0 {
            return Err(Error::InvalidConfig(
                "a prompt cache is loaded into an empty session: reset it first".into(),
            ));
        }
        let file = match open_checked(path, self.n_ctx) {
            Err(_) if !path.exists() => return Ok(PromptCache::Missing),
            Err(reason) => {
                return Err(Error::StateLoad {
                    from: path.display().to_string(),
                    reason,
                    session: "the session is unchanged",
                })
            }
            Ok(file) => file,
        };
        let cached = file.tokens.len();
        let common = common_prefix(&file.tokens, prompt);
        // loaded even when it will not be used, as llama-cli does: that checks it was made for
        // this model and these settings before the caller overwrites it
        let integrity =
            self.set_state_from(file.reader, file.tokens, path.display().to_string())?;
        if cached == 0 || common < cached || cached == prompt.len() {
            self.reset();
            return Ok(PromptCache::Unused { common, cached });
        }
        // Under H2O a state is what a fresh prefill of its tokens leaves when llama.cpp's counts
        // say that no position took the dense tail and every one is in a complete chunk (no
        // decoded token, no chunk left open): what Session::evaluate_saving_prompt_cache saves.
        // Only such a state continues exactly as a fresh run of the whole prompt would.
        if let Some(st) = self.h2o_state() {
            if st.tail_tokens > 0 || st.tokens_done as usize != cached {
                self.reset();
                return Ok(PromptCache::NotFresh { cached });
            }
        }
        // nothing in its history differs from a fresh prefill's
        self.fresh_until = u32::MAX;
        // but a fresh run of this prompt attends densely from where its dense tail starts: a
        // state that scored positions past that continues differently, and llama.cpp cannot cut
        // a loaded state back below where it was saved
        let n = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
        if (self.reusable(n, cached as u32) as usize) < cached {
            self.reset();
            return Ok(PromptCache::EndsInTail { cached });
        }
        Ok(PromptCache::Reused {
            tokens: cached,
            integrity,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(tokens: &[Token], tail: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&sys::LLAMA_SESSION_MAGIC.to_le_bytes());
        b.extend_from_slice(&sys::LLAMA_SESSION_VERSION.to_le_bytes());
        b.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
        for t in tokens {
            b.extend_from_slice(&t.to_le_bytes());
        }
        b.extend_from_slice(tail);
        b
    }

    #[test]
    fn header_gives_tokens_and_state_offset() {
        let h = parse_header(&state(&[5, 6, 7], b"xyz"), 10).unwrap();
        assert_eq!(h.tokens, vec![5, 6, 7]);
        assert_eq!(h.state_offset, 24);
    }

    #[test]
    fn bad_headers_name_the_problem() {
        let short = parse_header(&[1, 2, 3], 10).unwrap_err();
        assert!(short.contains("too short"), "{short}");
        let mut foreign = state(&[1], b"");
        foreign[0] ^= 0xff;
        let foreign = parse_header(&foreign, 10).unwrap_err();
        assert!(
            foreign.contains("not a llama.cpp session state"),
            "{foreign}"
        );
        let mut version = state(&[1], b"");
        version[4] = version[4].wrapping_add(1);
        let version = parse_header(&version, 10).unwrap_err();
        assert!(version.contains("version"), "{version}");
        let big = parse_header(&state(&[1, 2, 3], b""), 2).unwrap_err();
        assert!(big.contains("larger context"), "{big}");
        let mut cut = state(&[1, 2, 3], b"");
        cut.truncate(20);
        let cut = parse_header(&cut, 10).unwrap_err();
        assert!(cut.contains("truncated"), "{cut}");
    }

    #[test]
    fn common_prefix_counts_leading_agreement() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 3]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
    }
}
