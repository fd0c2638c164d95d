//! Entry points for the fuzz targets (`fuzz/`) and the replay of their corpus in the tests
//! (`tests/fuzz_corpus.rs`): the parsers that read bytes from outside, without a model.

/// Reads `bytes` as a saved state the way a load does before anything reaches llama.cpp: the
/// checked header (`state_file`), then behind it a session file's header and a server slot
/// file's header, for a context of `n_ctx` tokens. Returns what each reader said (the token
/// count it found, or why it refused). It must never panic, hang, or allocate more than the
/// bytes it is given warrant.
pub fn saved_state(bytes: &[u8], n_ctx: u32) -> [Result<usize, String>; 2] {
    crate::session::parse_saved_state(bytes, n_ctx)
}
