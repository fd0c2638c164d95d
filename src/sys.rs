//! Raw FFI to the patched llama.cpp: bindgen output of `llama.h` (with the ggml headers it
//! includes). Everything here is `unsafe` to use; the safe layer lives in the other modules.
#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    clippy::all
)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
