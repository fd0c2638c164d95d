#!/usr/bin/env bash
# Builds the engine and the C++ H2O tests with AddressSanitizer and UndefinedBehaviorSanitizer
# (in their own target dir and object-cache entries) and runs on the default model:
#   1. the C++ tests of the H2O state and kernel (tests/cpp),
#   2. the Rust integration tests whose prompts span several chunks (tests/h2o_state.rs,
#      tests/h2o_reference.rs), linked against the instrumented engine.
# (The Rust tests use the default model, whatever $1 says.) Any sanitizer report fails the run. The first build takes ~20 minutes on 2 cores (later ones
# rebuild only what changed): not part of CI.
#
#   scripts/sanitize.sh                      # address,undefined
#   H2O_LLAMA_SANITIZE=address scripts/sanitize.sh
#   scripts/sanitize.sh MODEL.gguf          # another model
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}/sanitize"
export H2O_LLAMA_SANITIZE="${H2O_LLAMA_SANITIZE:-address,undefined}"
# keep ggml's and llama.cpp's own asserts too
export H2O_LLAMA_DEBUG_ASSERTS=1

echo "== building with -fsanitize=$H2O_LLAMA_SANITIZE into $target" >&2
cargo build --release --tests --target-dir "$target" --message-format=json-render-diagnostics > "$target.json"
out=$(grep -o '"out_dir":"[^"]*h2o-llama-[^"]*"' "$target.json" | tail -1 | cut -d'"' -f4)
exe="$out/cpp-tests/test-h2o-kv-cache"
[ -x "$exe" ] || { echo "sanitize.sh: $exe was not built" >&2; exit 1; }

# the default model, fetched by `cargo test` or `h2o-cli` (same lookup as src/models.rs), or $1
cache="${H2O_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/h2o-llama}"
model="${1:-$cache/SmolLM2-135M-Instruct.Q4_1.gguf}"
[ -f "$model" ] || { echo "sanitize.sh: default model not found at $model (run cargo test once to fetch it)" >&2; exit 1; }

echo "== $exe $model" >&2
export ASAN_OPTIONS="${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"
"$exe" "$model"

# The Rust code is not instrumented, but every llama.cpp/ggml call it makes runs the
# instrumented engine: multi-chunk H2O prefills, memory-set reads, captures. The executables
# link libasan as an ordinary shared library, so ASan's "must come first" check is relaxed.
echo "== Rust multi-chunk H2O tests on the instrumented engine" >&2
ASAN_OPTIONS="$ASAN_OPTIONS:verify_asan_link_order=0" \
    cargo test --release --target-dir "$target" --test h2o_state --test h2o_reference -- --test-threads=1
echo "== sanitizers: clean" >&2
