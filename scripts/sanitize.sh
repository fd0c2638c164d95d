#!/usr/bin/env bash
# Builds the engine and the C++ H2O tests with AddressSanitizer and UndefinedBehaviorSanitizer
# (in their own target dir and object-cache entries) and runs the tests on the default model.
# Any sanitizer report fails the run. Takes several minutes on 2 cores: not part of CI.
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

# the default model, fetched by `cargo test` or `h2o-cli` (same lookup as src/default_model.rs), or $1
cache="${H2O_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/h2o-llama}"
model="${1:-$cache/SmolLM2-135M-Instruct.Q4_1.gguf}"
[ -f "$model" ] || { echo "sanitize.sh: default model not found at $model (run cargo test once to fetch it)" >&2; exit 1; }

echo "== $exe $model" >&2
export ASAN_OPTIONS="${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}"
"$exe" "$model"
echo "== sanitizers: clean" >&2
