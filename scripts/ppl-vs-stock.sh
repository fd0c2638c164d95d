#!/usr/bin/env bash
# Quality and speed of H2O against stock llama.cpp on your text, in one table: builds the pinned
# llama.cpp without our patches (target/stock) and with them, then
#   - stock:  perplexity of the unpatched build (full attention),
#   - H2O:    perplexity with H2O, plus the KL divergence of its token distributions from full
#             attention's and the top-1 agreement (h2o-cli perplexity; full attention there is
#             this build with H2O off, bit-identical to stock per h2o-cli/tests/stock_equivalence.rs),
#   - speed:  prefill tok/s of both builds at the window size (h2o-cli bench, 3 repetitions).
#
#   scripts/ppl-vs-stock.sh FILE [CTX=4096] [L=256] [H=256] [UB=1024]
set -euo pipefail
cd "$(dirname "$0")/.."
file="${1:?usage: scripts/ppl-vs-stock.sh FILE [CTX] [L] [H] [UB]}"
ctx="${2:-4096}"; L="${3:-256}"; H="${4:-256}"; ub="${5:-1024}"
[ -f "$file" ] || { echo "ppl-vs-stock.sh: $file: no such file" >&2; exit 1; }
target="${CARGO_TARGET_DIR:-target}"
export H2O_LLAMA_OBJ_CACHE="${H2O_LLAMA_OBJ_CACHE:-$PWD/$target/h2o-llama-objcache}"
echo "== building stock (no patches) into $target/stock and the patched h2o-cli" >&2
cargo build --release --locked --features stock --target-dir "$target/stock" --bin h2o-cli
cargo build --release --locked --bin h2o-cli
stock="$target/stock/release/h2o-cli"; ours="$target/release/h2o-cli"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
common=(-f "$file" -c "$ctx" -b "$ub" --ubatch-size "$ub" -t "${THREADS:-2}" --json)
echo "== perplexity, stock build" >&2
"$stock" perplexity "${common[@]}" --h2o-local 0 --h2o-heavy 0 > "$tmp/stock.json"
echo "== perplexity, H2O vs full attention" >&2
"$ours" perplexity "${common[@]}" --h2o-local "$L" --h2o-heavy "$H" > "$tmp/h2o.json"
echo "== prefill speed at $ctx tokens" >&2
"$ours" bench --stock-cli "$stock" -p "$ctx" -r 3 --ubatch-size "$ub" --h2o-local "$L" --h2o-heavy "$H" --json > "$tmp/bench.json"
python3 - "$tmp" "$file" <<'PY'
import json, sys
tmp, name = sys.argv[1], sys.argv[2]
s, h, b = (json.load(open(f"{tmp}/{k}.json")) for k in ("stock", "h2o", "bench"))
row = b["rows"][0]
print(f"text: {name} ({h['text_tokens']} tokens, {h['windows']} windows of -c {h['n_ctx']}) | "
      f"H2O L = {h['h2o']['local']} H = {h['h2o']['heavy']}, -ub {h['n_ubatch']} | perplexity of the second half of each window\n")
print("| ppl stock | ppl full attention (this build) | ppl H2O | Δ ppl vs stock | KLD mean | KLD p99 | top-1 agreement | prefill speed H2O / stock |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|")
ps, ph, p2 = s["second_half"]["ppl_full"], h["second_half"]["ppl_h2o"], h["second_half"]
print(f"| {ps:.4f} | {p2['ppl_full']:.4f} | {ph:.4f} | {100*(ph/ps-1):+.2f} % | {p2['kld_mean']:.5f} | "
      f"{p2['kld_p99']:.5f} | {p2['top1_agreement_percent']:.2f} % | {row['speedup']:.2f}× |")
PY
