//! The readers of saved states (a session's, a prompt cache, a server slot file) on arbitrary
//! bytes: the checked header and the headers behind it. They run before anything reaches
//! llama.cpp, so nothing they are given may make them panic, hang or allocate without bound.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // a context of 8,192 tokens, the default model's
    let _ = h2o_llama::fuzzing::saved_state(data, 8192);
});
