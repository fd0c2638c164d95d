#!/usr/bin/env bash
# Prefill speed of an experiment build (fewer-samples.patch, not kept) on the Qwen2.5-1.5B shape:
# with the CPU's default pool, the proposal among a tile's pool uses one query in H2O_POOL_EVERY
# of the tile (1: all 64, the default's own). One fresh process per cell, in the order given, so
# that configurations alternate in one run. A cell is N/EVERY, or N/stock for the pinned llama.cpp
# without patches (target/stock). One JSON record per line: {"n":N,"cfg":"EVERY|stock","rec":<h2o-cli --json>}.
# Usage: docs/results/coverage/pool-samples/run.sh OUT.jsonl BIN CELL...
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=${1:?OUT.jsonl}; bin=${2:?BIN}; shift 2
model=target/qwen2.5-1.5b-8-layers.gguf
: > "$out"
for cell in "$@"; do
    n=${cell%%/*}; cfg=${cell#*/}
    if [ "$cfg" = stock ]; then
        run=(target/stock/release/h2o-cli); flags=()
    else
        run=(env H2O_POOL_EVERY="$cfg" "$bin"); flags=(--h2o-local 256 --h2o-heavy 256)
    fi
    echo "pool-samples: $(date +%T) N = $n, $cfg" >&2
    rec=$("${run[@]}" -m "$model" --synthetic-prompt "$n" -c "$n" -b 4096 --ubatch-size 1024 -t 2 -n 0 --json \
        "${flags[@]}" 2>/tmp/pool-samples.err) || { cat /tmp/pool-samples.err >&2; exit 1; }
    printf '{"n":%d,"cfg":"%s","rec":%s}\n' "$n" "$cfg" "$rec" >> "$out"
done
