#!/usr/bin/env bash
# Regenerates the committed FFI bindings (src/sys/bindings_h2o.rs for the patched headers,
# src/sys/bindings_stock.rs for the pristine ones) with bindgen. Needs libclang
# (Debian: apt-get install libclang-dev). Run it after a patch changes a public header;
# the normal build refuses bindings whose recorded header digest does not match.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-target}/bindings"
for flavour in h2o stock; do
    features=generate-bindings
    [ "$flavour" = stock ] && features="generate-bindings,stock"
    echo "== generating $flavour bindings" >&2
    cargo build --release --lib --features "$features" --target-dir "$target" \
        --message-format=json-render-diagnostics > "$target.$flavour.json"
    out=$(grep -o '"out_dir":"[^"]*h2o-llama-[^"]*"' "$target.$flavour.json" | tail -1 | cut -d'"' -f4)
    cp "$out/bindings.rs" "src/sys/bindings_$flavour.rs"
    echo "   -> src/sys/bindings_$flavour.rs ($(grep -m1 headers-sha256 "src/sys/bindings_$flavour.rs"))" >&2
done
