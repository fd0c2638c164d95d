#!/usr/bin/env bash
# Two builds of h2o-cli, before and after a change that must not change results, interleaved on
# the Qwen2.5-1.5B shape with the default H2O settings, and stock at 1K (the ceiling) around them.
# One JSON record per line: {"n":N,"build":"before|after|stock","rec":<h2o-cli --json>}.
# Usage: docs/results/coverage/logit-reuse/run.sh OUT.jsonl BEFORE AFTER "8192 8192 32768" [MODEL]
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=${1:?OUT.jsonl}; before=${2:?BEFORE}; after=${3:?AFTER}; lengths=${4:?lengths}
model=${5:-target/qwen2.5-1.5b-8-layers.gguf}
stock=target/stock/release/h2o-cli
one() {
    local n=$1 name=$2 bin=$3
    shift 3
    echo "logit-reuse: $(date +%T) N = $n, $name" >&2
    rec=$("$bin" -m "$model" --synthetic-prompt "$n" -c "$n" -b 4096 --ubatch-size 1024 -t 2 -n 0 --json "$@" \
        2>/tmp/logit-reuse.err) || { cat /tmp/logit-reuse.err >&2; exit 1; }
    printf '{"n":%d,"build":"%s","rec":%s}\n' "$n" "$name" "$rec" >> "$out"
}
: > "$out"
one 1024 stock "$stock"
for n in $lengths; do
    one "$n" before "$before" --h2o-local 256 --h2o-heavy 256
    one "$n" after "$after" --h2o-local 256 --h2o-heavy 256
done
one 1024 stock "$stock"
