#!/usr/bin/env bash
# Where the prefill time goes, stock vs H2O: runs one N-token prefill of each build under
# `perf record` and splits the CPU samples into attention (flash attention or the H2O op, with
# the softmax, GEMM and memory-set helpers they call) and everything else (mostly the weight
# matrix products). For H2O it also gives memory selection's share: building the memory sets
# (the seed rule, ggml_h2o_build_memory_set) or choosing them by query (h2o_select_by_query),
# under the policy H2O_FLAGS gives (default: h2o-cli's, the recommended one). Needs perf (apt-get install linux-tools-common linux-tools-generic, or the
# distribution's perf package) and both builds (scripts/bench-vs-stock.sh makes them).
#
#   scripts/profile-attention.sh 4096            # -b 4096 -ub 1024 -t 2, L = H = 256
#   B=1024 scripts/profile-attention.sh 16384
#   H2O_FLAGS="--h2o-select seed --h2o-sink 0 --h2o-dense-tail 0" scripts/profile-attention.sh 8192
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:?usage: scripts/profile-attention.sh N_TOKENS}"
b="${B:-$(( n < 4096 ? n : 4096 ))}"
target="${CARGO_TARGET_DIR:-target}"
command -v perf >/dev/null || { echo "profile-attention.sh: perf is not installed" >&2; exit 1; }
for exe in "$target/stock/release/h2o-cli" "$target/release/h2o-cli"; do
    [ -x "$exe" ] || { echo "profile-attention.sh: $exe missing: run scripts/bench-vs-stock.sh -p 1024 -r 1 first" >&2; exit 1; }
done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
attention='flash_attn|soft_max|simd_gemm|h2o'
selection='h2o_build_memory_set|h2o_select_by_query'
read -ra policy <<< "${H2O_FLAGS:-}"
printf '| build | N | -b | prefill s | CPU samples | attention samples | attention share | attention s (share × prefill) | selection share |\n'
printf '|---|---:|---:|---:|---:|---:|---:|---:|---:|\n'
for build in stock h2o; do
    if [ $build = stock ]; then exe="$target/stock/release/h2o-cli"; extra=(); else exe="$target/release/h2o-cli"; extra=(--h2o-local 256 --h2o-heavy 256 "${policy[@]}"); fi
    perf record -q -F 499 -o "$tmp/$build.data" -- "$exe" --synthetic-prompt "$n" -c "$n" -b "$b" -ub 1024 -t 2 -n 0 --json "${extra[@]}" > "$tmp/$build.json" 2>/dev/null
    prefill=$(python3 -c "import json; print(json.load(open('$tmp/$build.json'))['prefill_ms']/1000)")
    perf report -q -i "$tmp/$build.data" -n --sort symbol --stdio 2>/dev/null > "$tmp/$build.txt"
    awk -v pat="$attention" -v sel="$selection" -v build="$build" -v n="$n" -v b="$b" -v prefill="$prefill" '
        $2 ~ /^[0-9]+$/ { total += $2; if ($0 ~ pat) att += $2; if ($0 ~ sel) s += $2 }
        END {
            share = build == "stock" ? "–" : sprintf("%.2f %%", 100*s/total)
            printf "| %s | %d | %d | %.1f | %d | %d | %.1f %% | %.1f | %s |\n", build, n, b, prefill, total, att, 100*att/total, prefill*att/total, share
        }
    ' "$tmp/$build.txt"
done
