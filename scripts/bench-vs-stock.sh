#!/usr/bin/env bash
# Prefill speed of H2O against stock llama.cpp: builds the pinned llama.cpp twice, without our
# patches (cargo feature `stock`, into target/stock) and with them, then runs `h2o-cli bench`,
# which alternates the two builds for every repetition and prompt length. Arguments go to
# `h2o-cli bench` (see `h2o-cli bench --help`), e.g.
#
#   scripts/bench-vs-stock.sh                          # N = 1K..16K, 3 repetitions: long
#   scripts/bench-vs-stock.sh -p 1024,4096 -r 3 -b 1024
#   scripts/bench-vs-stock.sh -p 4096 --json > bench.json
#
# Both builds share the object cache, so the second costs only the units the patches change.
set -euo pipefail
cd "$(dirname "$0")/.."

target="${CARGO_TARGET_DIR:-target}"
export H2O_LLAMA_OBJ_CACHE="${H2O_LLAMA_OBJ_CACHE:-$PWD/$target/h2o-llama-objcache}"
echo "== building stock (no patches) into $target/stock and the patched h2o-cli" >&2
cargo build --release --locked --features stock --target-dir "$target/stock" --bin h2o-cli
cargo build --release --locked --bin h2o-cli
exec "$target/release/h2o-cli" bench --stock-cli "$target/stock/release/h2o-cli" "$@"
