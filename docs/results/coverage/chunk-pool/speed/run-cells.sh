#!/usr/bin/env bash
# Prefill speed, one fresh process per cell, in the order given, so that configurations
# alternate in one run. A cell is N/CONFIG: stock (the pinned llama.cpp without patches, built as
# target/stock), default (this build's defaults with L = H = 256: on the CPU the pool of 8,192),
# or nopool (the same with --h2o-tile-pool 0, the default before). One JSON record per line:
# {"n":N,"cfg":"CONFIG","rec":<h2o-cli --json>}.
# Usage: docs/results/coverage/chunk-pool/speed/run-cells.sh OUT.jsonl MODEL CELL...
set -euo pipefail
cd "$(dirname "$0")/../../../../.."
out=${1:?OUT.jsonl}; model=${2:?MODEL}; shift 2
: > "$out"
for cell in "$@"; do
    n=${cell%%/*}; cfg=${cell#*/}
    case $cfg in
        stock) bin=target/stock/release/h2o-cli; flags=() ;;
        default) bin=target/release/h2o-cli; flags=(--h2o-local 256 --h2o-heavy 256) ;;
        nopool) bin=target/release/h2o-cli; flags=(--h2o-local 256 --h2o-heavy 256 --h2o-tile-pool 0) ;;
        *) echo "run-cells.sh: unknown configuration $cfg (stock, default, nopool)" >&2; exit 2 ;;
    esac
    echo "run-cells: $(date +%T) N = $n, $cfg" >&2
    rec=$("$bin" -m "$model" --synthetic-prompt "$n" -c "$n" -b 4096 --ubatch-size 1024 -t 2 -n 0 --json \
        "${flags[@]}" 2>/tmp/run-cells.err) || { cat /tmp/run-cells.err >&2; exit 1; }
    printf '{"n":%d,"cfg":"%s","rec":%s}\n' "$n" "$cfg" "$rec" >> "$out"
done
