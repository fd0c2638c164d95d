#!/usr/bin/env bash
# Where the prefill's time goes on the Qwen2.5-1.5B shape, and how speed holds out to 64K: one
# interleaved run of an experiment build (instrumentation.patch on the engine, not kept), which
# with H2O_STAGE_TIMES=1 prints at exit the thread-seconds spent in each part of the coverage op:
# stage 1 (the pool's scan and the tiles' proposals), the chunk's own part of the attention,
# stage 2 (the ranking), the memory part, and the whole op.
# Usage: docs/results/coverage/stage-split/run.sh OUT.jsonl "8192 32768 65536" [BIN] [MODEL]
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=${1:?OUT.jsonl}; lengths=${2:?lengths}
bin=${3:-target/h2o-cli.stagetimes}
model=${4:-target/qwen2.5-1.5b-8-layers.gguf}
mem="--h2o-local 256 --h2o-heavy 256"
configs=(
    "coverage|$mem"
    "pool-4096|$mem --h2o-tile-pool 4096"
    "pool-2048|$mem --h2o-tile-pool 2048"
)
: > "$out"
for n in $lengths; do
    for cfg in "${configs[@]}"; do
        IFS='|' read -r name flags <<< "$cfg"
        echo "stage-split: $(date +%T) N = $n, $name" >&2
        # shellcheck disable=SC2086 # flags are words
        rec=$(H2O_STAGE_TIMES=1 "$bin" -m "$model" --synthetic-prompt "$n" -c "$n" -b 4096 --ubatch-size 1024 -t 2 -n 0 \
            --json $flags 2>/tmp/stage-split.err) || { cat /tmp/stage-split.err >&2; exit 1; }
        times=$(grep -o 'stage_times_s.*' /tmp/stage-split.err || true)
        printf '{"n":%d,"cfg":"%s","times":"%s","rec":%s}\n' "$n" "$name" "$times" "$rec" >> "$out"
    done
done
