#!/usr/bin/env bash
# What each stage of coverage selection's estimator costs the prefill, measured two ways in one
# interleaved run (an experiment build of patch 0042 with instrumentation.patch, not kept):
#  - wall clock: the prefill with a stage's work skipped (H2O_SKIP_STAGE1: the candidates spread
#    evenly instead of proposed by the samples; H2O_SKIP_STAGE2: no ranking, an even budget),
#    beside the whole estimator, the hybrid and stock;
#  - thread time: H2O_STAGE_TIMES=1 prints the seconds the threads spent in stage 1, in the
#    chunk's own part (which the attention needs anyway) and in stage 2.
# Usage: docs/results/coverage/stages/run.sh OUT.jsonl "4096 8192 16384" REPS
set -euo pipefail
cd "$(dirname "$0")/../../../.."
out=${1:?OUT.jsonl}; lengths=${2:?lengths}; reps=${3:?reps}
exp=target/exp/release/h2o-cli
stock=target/stock/release/h2o-cli
mem="--h2o-local 256 --h2o-heavy 256"
configs=(
    "stock||"
    "hybrid||$mem --h2o-select hybrid"
    "coverage|H2O_STAGE_TIMES=1|$mem --h2o-select coverage"
    "coverage-no-stage1|H2O_STAGE_TIMES=1 H2O_SKIP_STAGE1=1|$mem --h2o-select coverage"
    "coverage-no-stage2|H2O_STAGE_TIMES=1 H2O_SKIP_STAGE2=1|$mem --h2o-select coverage"
    "coverage-no-stages|H2O_STAGE_TIMES=1 H2O_SKIP_STAGE1=1 H2O_SKIP_STAGE2=1|$mem --h2o-select coverage"
)
: > "$out"
for rep in $(seq 1 "$reps"); do
    for n in $lengths; do
        for cfg in "${configs[@]}"; do
            IFS='|' read -r name envs flags <<< "$cfg"
            bin=$exp
            [[ $name == stock ]] && bin=$stock
            echo "stages: $(date +%T) rep $rep/$reps, N = $n, $name" >&2
            # shellcheck disable=SC2086 # envs and flags are words
            rec=$(env $envs "$bin" --synthetic-prompt "$n" -c "$n" -b 4096 --ubatch-size 1024 -t 2 -n 0 --json $flags 2>/tmp/stages.err)
            times=$(grep -o 'stage_times_s.*' /tmp/stages.err || true)
            printf '{"rep":%d,"n":%d,"cfg":"%s","times":"%s","rec":%s}\n' "$rep" "$n" "$name" "$times" "$rec" >> "$out"
        done
    done
done
